"""A real D-Bus for the tests: a private dbus-daemon (its own config, its own socket) and
tests/fake_systemd_bus.py serving org.freedesktop.systemd1 on it, acting on a fake cgroup
tree. The shim's writer is pointed at it with DBUS_SYSTEM_BUS_ADDRESS, as on a node where
the system bus lives elsewhere."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from jeepney import DBusAddress, MessageType, new_method_call
from jeepney.io.blocking import open_dbus_connection

from tests.tools import require_tool

HERE = os.path.dirname(os.path.abspath(__file__))
MANAGER = DBusAddress("/org/freedesktop/systemd1", bus_name="org.freedesktop.systemd1",
                      interface="org.freedesktop.systemd1.Manager")
CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_destination="*"/>
    <allow receive_sender="*"/>
  </policy>
</busconfig>
"""


class PrivateBus:
    """dbus-daemon on a socket of its own; ``stop()`` and ``start()`` again on the same address."""

    def __init__(self):
        self.exe = require_tool("dbus-daemon")
        self.dir = tempfile.mkdtemp(prefix="memqos-bus-")  # short: a socket path has 108 bytes
        self.socket = os.path.join(self.dir, "bus")
        self.address = f"unix:path={self.socket}"
        self.config = os.path.join(self.dir, "bus.conf")
        with open(self.config, "w") as f:
            f.write(CONFIG.format(socket=self.socket))
        self.proc: subprocess.Popen | None = None

    def start(self) -> "PrivateBus":
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        self.proc = subprocess.Popen([self.exe, f"--config-file={self.config}", "--nofork", "--nopidfile",
                                      "--print-address=1"], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     text=True)
        line = self.proc.stdout.readline().strip()  # printed once it listens
        assert line.startswith("unix:"), f"dbus-daemon did not start: {line!r}"
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class FakeSystemdBus:
    """org.freedesktop.systemd1 on a PrivateBus (tests/fake_systemd_bus.py), over ``tree``."""

    def __init__(self, tmp, tree, units=(), *, bus: PrivateBus | None = None):
        self.tree = tree
        self.bus = bus or PrivateBus().start()
        self.state_path = str(tmp / "systemd-state.json")
        state = {"root": str(tree.root), "units": {p.rsplit("/", 1)[-1]: p for p in units}, "props": {}, "calls": []}
        with open(self.state_path, "w") as f:
            json.dump(state, f)
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def address(self) -> str:
        return self.bus.address

    def start(self) -> None:
        """The service on the bus (again, with the state it had)."""
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "fake_systemd_bus.py"), self.bus.address,
                                      self.state_path], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline().strip()
        assert line == "ready", f"fake systemd did not start: {line!r}"

    def bus_gone(self) -> None:
        """The system bus goes away (dbus-daemon killed; the service exits with it)."""
        self.bus.stop()
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def bus_back(self) -> None:
        self.bus.start()
        self.start()

    def env(self, monkeypatch) -> None:
        monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", self.bus.address)

    def state(self) -> dict:
        with open(self.state_path) as f:
            return json.load(f)

    def calls(self, member: str = "SetUnitProperties") -> list[dict]:
        return [c for c in self.state()["calls"] if c["member"] == member]

    def call(self, member: str, signature: str | None = None, body: tuple = ()):
        """A call of the test's own to the Manager (as the kubelet or systemctl would make it):
        the reply message."""
        with open_dbus_connection(self.bus.address) as conn:
            return conn.send_and_get_reply(new_method_call(MANAGER, member, signature, body), timeout=10)

    def reload(self) -> None:
        """systemctl daemon-reload."""
        assert self.call("Reload").header.message_type == MessageType.method_return

    def set_property(self, unit: str, prop: str, value: int) -> None:
        """systemctl set-property --runtime UNIT PROP=VALUE."""
        reply = self.call("SetUnitProperties", "sba(sv)", (unit, True, [(prop, ("t", value))]))
        assert reply.header.message_type == MessageType.method_return, reply.body

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.bus.close()


def wait_until(cond, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()
