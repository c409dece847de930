"""`memqos-shim nri` as a process of the guest: the NRI scenario's plugin (e2e/nri_scenario.py),
and the base of the image's plugin (e2e/nri_image.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import time

from guest_common import CGROOT, CHECKOUT, InfraError, T0, read_audit, spawn

NRI_SOCK = "/var/run/nri/nri.sock"


class Plugin:
    """`memqos-shim nri` as a process of the guest."""

    def __init__(self, python: str, logs: str, kubelet_config: str, meminfo: str):
        self.python = python
        self.audit_log = os.path.join(logs, "nri-audit.jsonl")
        self.log = os.path.join(logs, "nri-plugin.log")
        self.args = ["nri", "--nri-socket", NRI_SOCK, "--kubelet-config", kubelet_config,
                     "--cgroup-root", CGROOT, "--meminfo", meminfo, "--audit-log", self.audit_log,
                     "--log-level", "debug"]  # each runtime call's times and each loop hold-up in its log
        self.proc: subprocess.Popen | None = None

    def events(self, event: str) -> list[dict]:
        return [r for r in read_audit(self.audit_log) if r.get("event") == event]

    def use_kubelet_config(self, path: str) -> str:
        """Read the KubeletConfiguration at ``path`` from the next start on; returns the one before."""
        at = self.args.index("--kubelet-config") + 1
        before, self.args[at] = self.args[at], path
        return before

    def start(self) -> None:
        with open(self.log, "a") as f:
            f.write(f"==== start t+{time.time() - T0:.1f}s: {self.python} -m shim {' '.join(self.args)}\n")
        env = dict(os.environ, PYTHONPATH=CHECKOUT, PYTHONDONTWRITEBYTECODE="1")
        self.proc = spawn([self.python, "-m", "shim", *self.args], "system.slice/memqos-shim.app.service",
                          self.log, env=env, cwd=CHECKOUT)

    def wait_synced(self, count: int, timeout: float = 240) -> float:
        """Until the audit holds `count` Synchronize records; the seconds it took."""
        t = time.time()
        while len(self.events("nri-synchronize")) < count:
            if self.proc.poll() is not None:
                raise InfraError(f"memqos-shim nri exited with code {self.proc.returncode} (log {self.log})")
            if time.time() - t > timeout:
                raise InfraError(f"memqos-shim nri: no Synchronize #{count} after {timeout:.0f} s "
                                 f"(containerd.log / {self.log})")
            time.sleep(0.2)
        return time.time() - t

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)
        with open(self.log, "a") as f:
            f.write(f"==== signal {sig} t+{time.time() - T0:.1f}s\n")
        if sig in (signal.SIGKILL, signal.SIGTERM):
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
