#!/usr/bin/env python3
"""A stand-in for systemd's D-Bus API in the unit tests: org.freedesktop.systemd1 on a bus
(a private dbus-daemon, tests/systemd_bus_support.py), the Manager methods the shim and the
tests call, with systemd's argument checks and error names, acting on a fake cgroup tree the
way systemd acts on /sys/fs/cgroup.

    python tests/fake_systemd_bus.py ADDRESS STATE

STATE (JSON) is read at start and written after every call:
  {"root": cgroup root, "units": {unit: cgroup path relative to root},
   "props": {unit: {property: value}}, "calls": [{"member", "signature", "unit", "runtime",
   "props": [[name, variant signature, value], ...]}, ...]}

  SetUnitProperties(s name, b runtime, a(sv) properties), signature "sba(sv)" exactly:
      MemoryMin/MemoryLow/MemoryHigh/MemoryMax must be 't' (uint64 bytes), CPUWeight 't';
      another property: org.freedesktop.DBus.Error.PropertyReadOnly ("Cannot set property
      X, or unknown property."), another type: org.freedesktop.DBus.Error.InvalidArgs. Stores
      the properties and writes memory.min / memory.low of the unit's cgroup (systemd applies
      what it is told). A service or scope systemd does not know:
      org.freedesktop.systemd1.NoSuchUnit ("Unit X not found."); a slice it does not know is
      loaded on the spot, gets the property and a cgroup (what systemd 252 does).
  Reload(): re-applies every loaded unit's memory.min / memory.low from its properties (0
      when unset): what daemon-reload does to values written behind systemd's back.
Prints "ready" on stdout once it owns the name; exits when the bus goes away.
"""
from __future__ import annotations

import json
import os
import sys

from jeepney import HeaderFields, MessageType, new_error, new_method_return
from jeepney.io.blocking import open_dbus_connection

NAME = "org.freedesktop.systemd1"
PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
TYPES = {"MemoryMin": "t", "MemoryLow": "t", "MemoryHigh": "t", "MemoryMax": "t", "CPUWeight": "t"}
FILES = {"MemoryMin": "memory.min", "MemoryLow": "memory.low"}


class Refused(Exception):
    def __init__(self, name: str, text: str):
        super().__init__(text)
        self.name = name


def slice_path(name: str) -> str:
    words = name[: -len(".slice")].split("-")
    return "/".join("-".join(words[: i + 1]) + ".slice" for i in range(len(words)))


class FakeSystemd:
    def __init__(self, state_path: str):
        self.state_path = state_path
        with open(state_path) as f:
            self.state = json.load(f)
        self.state.setdefault("units", {})
        self.state.setdefault("props", {})
        self.state.setdefault("calls", [])

    def save(self) -> None:
        tmp = self.state_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.state, f)
        os.replace(tmp, self.state_path)

    def apply(self, unit: str) -> None:
        path = os.path.join(self.state["root"], self.state["units"][unit])
        props = self.state["props"].get(unit, {})
        for prop, file in FILES.items():
            f = os.path.join(path, file)
            if os.path.exists(f):
                with open(f, "w") as fh:
                    fh.write(f"{props.get(prop, 0)}\n")

    def set_unit_properties(self, signature: str, body: tuple) -> None:
        if signature != "sba(sv)":
            raise Refused("org.freedesktop.DBus.Error.InvalidArgs",
                          f"SetUnitProperties takes sba(sv), not {signature!r}")
        unit, runtime, props = body
        self.state["calls"][-1].update(unit=unit, runtime=runtime, props=[[n, sig, v] for n, (sig, v) in props])
        parsed = {}
        for name, (sig, value) in props:
            if name not in TYPES:
                raise Refused("org.freedesktop.DBus.Error.PropertyReadOnly",
                              f"Cannot set property {name}, or unknown property.")
            if sig != TYPES[name]:
                raise Refused("org.freedesktop.DBus.Error.InvalidArgs",
                              f"Invalid argument: {name} takes {TYPES[name]!r}, not {sig!r}")
            parsed[name] = value
        if unit not in self.state["units"]:
            if not unit.endswith(".slice"):
                raise Refused("org.freedesktop.systemd1.NoSuchUnit", f"Unit {unit} not found.")
            self.state["units"][unit] = slice_path(unit)
            d = os.path.join(self.state["root"], self.state["units"][unit])
            os.makedirs(d, exist_ok=True)
            for file in FILES.values():  # the kernel's files of a new cgroup
                if not os.path.exists(os.path.join(d, file)):
                    with open(os.path.join(d, file), "w") as fh:
                        fh.write("0\n")
        self.state["props"].setdefault(unit, {}).update(parsed)
        self.apply(unit)

    def reload(self) -> None:
        for unit in self.state["units"]:
            self.apply(unit)

    def handle(self, msg) -> tuple[str, str] | None:
        """None: answered with an empty return; else (error name, text)."""
        fields = msg.header.fields
        member = fields.get(HeaderFields.member)
        signature = fields.get(HeaderFields.signature, "")
        self.state["calls"].append({"member": member, "signature": signature})
        try:
            if fields.get(HeaderFields.path) != PATH or fields.get(HeaderFields.interface) != MANAGER:
                raise Refused("org.freedesktop.DBus.Error.UnknownMethod", f"no {member} here")
            if member == "SetUnitProperties":
                self.set_unit_properties(signature, msg.body)
            elif member == "Reload":
                self.reload()
            else:
                raise Refused("org.freedesktop.DBus.Error.UnknownMethod", f"Unknown method {member}")
            return None
        except Refused as e:
            self.state["calls"][-1]["error"] = e.name
            return e.name, str(e)
        finally:
            self.save()


def main(argv: list[str]) -> int:
    address, state_path = argv
    systemd = FakeSystemd(state_path)
    conn = open_dbus_connection(address)
    reply = conn.bus_proxy.RequestName(NAME, 4)  # DBUS_NAME_FLAG_DO_NOT_QUEUE
    if reply[0] != 1:  # DBUS_REQUEST_NAME_REPLY_PRIMARY_OWNER
        print(f"cannot own {NAME}: {reply}", file=sys.stderr)
        return 1
    print("ready", flush=True)
    while True:
        try:
            msg = conn.receive()
        except (ConnectionError, OSError):
            return 0
        if msg.header.message_type != MessageType.method_call:
            continue
        refused = systemd.handle(msg)
        if refused is None:
            conn.send(new_method_return(msg))
        else:
            conn.send(new_error(msg, refused[0], "s", (refused[1],)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
