"""Phases "cgroupfs" and "dbus" of the systemd guest (e2e/guest_systemd.py), and the probe of what the
real systemd refuses: methods of guest_systemd.Guest (its state and helpers are Guest's)."""
from __future__ import annotations

import os
import subprocess
import time

import expect as X
from guest_common import cg_read
from guest_common import CGROOT, CHECKOUT, MI

SCENARIO = "systemd"
NO_PATH = "/nonexistent-memqos-path"  # the shims' PATH


class SystemdPhases:
    """The phases of Guest (its state and helpers are Guest's)."""

    def probe_failures(self) -> None:
        """What the real systemd does where tests/fake_systemd_bus.py imitates it: a slice
        and a service systemd has not loaded, an unknown property, a value that is not a size
        (recorded); the shim's D-Bus client must turn a refusal into a SystemdError."""
        from shim.effects.systemd_bus import SystemdBus, SystemdError

        out = {}
        for name, argv in (("slice-not-loaded", ["kubepods-burstable-podnosuch.slice", "MemoryMin=4096"]),
                           ("service-not-loaded", ["nosuch-e2e.service", "MemoryMin=4096"]),
                           ("unknown-property", ["kubepods.slice", "NoSuchProperty=1"]),
                           ("bad-value", ["kubepods.slice", "MemoryMin=lots"])):
            p = self.run(["systemctl", "set-property", "--runtime", "--", *argv], check=False)
            out[name] = {"exit": p.returncode, "stderr": p.stderr.strip()}
        unit = "kubepods-burstable-podnosuch.slice"
        out["slice-not-loaded"]["after"] = {
            "LoadState": self.show(unit, "LoadState"), "ActiveState": self.show(unit, "ActiveState"),
            "MemoryMin": self.show(unit, "MemoryMin"),
            "cgroup_exists": os.path.isdir(os.path.join(CGROOT, "kubepods.slice/kubepods-burstable.slice", unit)),
            "files": sorted(os.path.join(r, f) for d in ("/run/systemd/system.control", "/run/systemd/transient")
                            for r, _d, fs in os.walk(d) for f in fs if "podnosuch" in r + f)}
        try:
            SystemdBus().set_unit_properties("nosuch-e2e.service", [("MemoryMin", 4096)])
            err = "(no error)"
        except SystemdError as e:
            err = str(e)
        out["wrapper"] = err
        self.data["systemctl_failures"] = out
        self.report.check(SCENARIO, "setup", "SetUnitProperties refused by systemd (a service it has not loaded)",
                          "shim.effects.systemd_bus.SystemdBus", "SystemdError", "SystemdError" if err != "(no error)"
                          else err, err, source="systemd", ok=(err != "(no error)") == (out["service-not-loaded"]["exit"] != 0))

    def phase_cgroupfs(self) -> None:
        self.phase = "cgroupfs"
        self.start_shim("cgroupfs", "cgroupfs")
        self.create_pod("guaranteed", X.GUARANTEED, 64 * MI, 64 * MI, False)
        self.create_pod("burstable-limit", X.BURSTABLE, 32 * MI, 96 * MI, True)
        self.create_pod("burstable-nolimit", X.BURSTABLE, 48 * MI, 0, True)
        self.create_pod("besteffort", X.BESTEFFORT, 0, 0, False)
        self.check_containers("created")
        # what systemd knows of the container scopes runc made (recorded, not asserted)
        self.data["scopes"] = {p["name"]: {prop: self.show(p["scope"].rsplit("/", 1)[-1], prop)
                                           for prop in ("MemoryMin", "MemoryLow", "MemoryHigh", "MemoryMax",
                                                        "Delegate")}
                               for p in self.pods.values()}
        settled = self.wait_levels(self.args.settle)
        self.snapshot("created")
        self.check_levels("created")
        self.data["phases"]["cgroupfs"] = {"settled_s": settled}
        self.check("created", "the shim's writer", self.audit_log + " reconciler-active.writes", "cgroupfs",
                   self.writer_of_shim(), "--systemd-writes cgroupfs", source="audit")
        # the disturbance, with the shim frozen: what systemd does to values written to cgroupfs
        self.freeze_shim(True)
        d = self.disturb()
        self.snapshot("after daemon-reload + SetUnitProperties, shim frozen")
        for unit, path, f, v, why in self.level_expectations():
            if v == 0:
                continue
            actual = cg_read(path, f)
            self.check("disturbed", f"{unit}: a value written to cgroupfs, after daemon-reload + SetUnitProperties",
                       f"{CGROOT}/{path}/{f}", "0 (reset by systemd)", actual,
                       f"the shim wrote {v} to the file; systemd knows MemoryMin={self.show(unit, 'MemoryMin')} and "
                       "re-applies it (kubernetes#138431): this must happen for the dbus phase's check to mean "
                       "anything", ok=actual == "0")
        self.check_containers("disturbed")
        # thawed: the shim repairs the drift at its next resync
        t = time.time()
        self.freeze_shim(False)
        restored = self.wait_levels(self.args.resync + self.args.settle)
        self.data["restore"]["cgroupfs"] = {"disturb": d, "restored_after_s": None if restored is None else
                                            round(time.time() - t, 2)}
        limit = self.args.resync + self.args.restore_slack
        self.check("restored", "pod/QoS/kubepods values after the shim was thawed", "(all of them)",
                   f"<= {limit:g} s (one resync {self.args.resync:g} s + {self.args.restore_slack:g} s)",
                   "never" if restored is None else f"{restored:.1f} s",
                   "the reconciler repairs drift at its periodic resync", ok=restored is not None and restored <= limit)
        self.check_levels("restored")
        self.snapshot("restored by the shim")
        # the same with the shim running: how long the node is without its values
        d = self.disturb(settle=False)
        w = self.watch_levels(self.args.resync + self.args.restore_slack)
        self.data["restore"]["cgroupfs-live"] = {"disturb": d, "watch": w}
        self.check("live", "pod/QoS/kubepods values, shim running, sampled every 0.1 s after the disturbance",
                   "(all of them)", f"right again within {limit:g} s",
                   f"wrong in {w['wrong_samples']}/{w['samples']} samples, right again after {w['right_again_s']} s"
                   if w["wrong_samples"] else f"never wrong in {w['samples']} samples",
                   "systemd resets them, the next resync repairs them", ok=w["right_at_end"] and
                   (w["right_again_s"] or 0) <= limit)
        self.stop_shim()

    def phase_dbus(self) -> None:
        self.phase = "dbus"
        mode = self.args.writes
        self.start_shim("dbus", mode)
        settled = self.wait_levels(self.args.settle)
        # the values already read right (cgroupfs phase): wait for the shim to have told systemd
        deadline = time.time() + self.args.settle
        want = {(u, {"memory.min": "MemoryMin", "memory.low": "MemoryLow"}[f]): str(v)
                for u, _p, f, v, _w in self.level_expectations()}
        while time.time() < deadline and mode != "cgroupfs":
            if all(self.show(u, p) == v for (u, p), v in want.items()):
                break
            time.sleep(0.5)
        self.data["phases"]["dbus"] = {"settled_s": settled, "mode": mode}
        self.check("started", "the shim's writer", self.audit_log + " reconciler-active.writes", "systemd",
                   self.writer_of_shim(), f"--systemd-writes {mode}: cgroup driver systemd and systemd is PID 1",
                   source="audit")
        self.check_levels("started")
        self.check_systemd_knows("started")
        via = sorted({str(r.get("via", "cgroupfs")) for r in self.audit() if r.get("event") == "cgroup-write"})
        self.check("started", "how the shim wrote", self.audit_log + " cgroup-write.via", "['systemd']", str(via),
                   "every pod/QoS/node write through SetUnitProperties", source="audit")
        for step in ("disturbed", "disturbed-again"):
            self.freeze_shim(True)
            d = self.disturb()
            self.snapshot(f"{step}: after daemon-reload + SetUnitProperties, shim frozen")
            self.check_levels(step, "survives daemon-reload + SetUnitProperties with the shim frozen")
            self.check_containers(step)
            self.freeze_shim(False)
            self.data["restore"][f"dbus-{step}"] = {"disturb": d}
            if step == "disturbed":
                gone = self.pods["burstable-nolimit"]["slice"]
                self.remove_pod("burstable-nolimit")
                # where systemd keeps runtime properties, and whether the stopped pod slice's stay
                left = []
                for d in ("/run/systemd/system.control", "/run/systemd/transient"):
                    for root, _dirs, files in os.walk(d):
                        left += [os.path.join(root, f) for f in files]
                self.data["runtime_property_files"] = sorted(left)
                self.data["removed_slice_files_left"] = sorted(f for f in left if gone in f)
                settled = self.wait_levels(self.args.settle)
                self.data["phases"]["dbus"]["removed_settled_s"] = settled
                self.check_levels("pod-removed")
                self.check_systemd_knows("pod-removed")
                self.snapshot("burstable-nolimit removed")
        d = self.disturb(settle=False)
        w = self.watch_levels(self.args.resync + 2)
        self.data["restore"]["dbus-live"] = {"disturb": d, "watch": w}
        self.check("live", "pod/QoS/kubepods values, shim running, sampled every 0.1 s after the disturbance",
                   "(all of them)", "never wrong",
                   f"wrong in {w['wrong_samples']}/{w['samples']} samples, right again after {w['right_again_s']} s"
                   if w["wrong_samples"] else "never wrong",
                   "systemd re-applies the MemoryMin/MemoryLow it was given", ok=w["wrong_samples"] == 0)
        self.stop_shim()
        # memqos-shim reset: through systemd too, so a reload does not bring the values back
        env = dict(os.environ, PYTHONPATH=CHECKOUT, PYTHONDONTWRITEBYTECODE="1", PATH=NO_PATH)
        p = subprocess.run([self.args.python, "-m", "shim", "reset", "--kubelet-config", self.kubelet_config,
                            "--cgroup-root", CGROOT, "--audit-log", os.path.join(self.logs, "reset-audit.jsonl"),
                            "--systemd-writes", mode], capture_output=True, text=True, env=env, cwd=CHECKOUT,
                           timeout=300)
        with open(os.path.join(self.logs, "reset.log"), "w") as f:
            f.write(p.stdout + p.stderr + f"exit {p.returncode}\n")
        self.check("reset", "memqos-shim reset", "exit code", "0", str(p.returncode), p.stderr.strip()[-300:],
                   source="process")
        for step in ("reset", "reset-disturbed"):
            if step == "reset-disturbed":
                self.disturb()
            self.snapshot(step)
            for unit, path, f, _v, _why in self.level_expectations():
                self.check(step, f"{unit} after memqos-shim reset", f"{CGROOT}/{path}/{f}", "0", cg_read(path, f),
                           "reset sets every managed value to 0" +
                           ("; and systemd keeps 0 after daemon-reload + SetUnitProperties" if step != "reset" else ""))
