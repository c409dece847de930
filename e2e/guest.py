#!/usr/bin/env python3
"""Guest side of the real-kernel suite: runs as root inside the virtme-ng VM (cgroup v2).

Started by scripts/e2e-vm with the checkout's .venv python. It
  1. enables the cgroup controllers, starts containerd (root/state on tmpfs) in
     /system.slice/containerd.service and imports the local images;
  2. per scenario (one recorded kubelet trace each, e2e/guest_traces.py): starts the shim from the checkout in
     /system.slice/memqos-shim.app.service in front of containerd, replays the kubelet's own
     requests (ImageStatus, RunPodSandbox, CreateContainer, StartContainer, later StopContainer,
     StopPodSandbox, RemoveContainer, RemovePodSandbox) through the shim's socket with the
     recorded ids mapped to the new ones, and reads back /sys/fs/cgroup after each step:
     created, updated (UpdateContainerResources), pods removed, shim killed with SIGKILL,
     shim restarted, `memqos-shim reset`;
  3. with --guard, the PSI guard scenario (GuardScenario, e2e/guest_guard.py): a container running e2e/hog.c
     crawls at memory.high; with --guard-action none it is still near memory.high after the
     guard's window, with relax its memory.high becomes max within window + one interval and it
     completes or is OOM-killed at memory.max;
  3b. with --reclaim, the proactive reclaim scenario (ReclaimScenario, e2e/guest_reclaim.py): a page-cache reader
     without and with --reclaim, one after the other and side by side, plus the anon hog;
  3c. with --pressure quick|full, the protection benchmark (PressureScenario, e2e/guest_pressure.py): kubelet-laid
     cgroups under page cache and node pressure with each value set (none, a gate-on kubelet's, the shim's);
     it needs no runtime: alone, containerd is not started;
  4. writes OUT/report-guest.json (every asserted file with expected and actual value; the
     guard's timings under "guard", the reclaim tables under "reclaim") and the logs (containerd, shim, audit, cgroup snapshots,
     guard-timeline.jsonl) under OUT/logs.

Expected values come from e2e/expect.py (own arithmetic, not the shim's). Exit code:
0 all checks passed, 1 a check failed, 3 infrastructure error (containerd, images, shim
would not start...): the host tells these apart from a boot failure by the report's presence.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKOUT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, CHECKOUT)

from guest_common import InfraError, Report, T0, log, reconciler_available, setup_cgroups  # noqa: E402
from guest_guard import GuardScenario  # noqa: E402
from guest_pressure import PressureScenario  # noqa: E402
from guest_reclaim import ReclaimScenario  # noqa: E402
from guest_stack import check_stack_binaries, guest_facts, load_stack, start_containerd, systemd_usable  # noqa: E402
from guest_traces import Scenario  # noqa: E402


def run_scenario(name: str, scenario, report: Report) -> None:
    """Run one scenario; an error in it is recorded and the next scenario still runs. Its
    teardown always runs and the report is saved after it."""
    try:
        scenario.run()
    except InfraError as e:
        report.data["errors"].append(f"{name}: {e}")
        log(f"INFRA ERROR in {name}: {e}")
    except Exception:  # noqa: BLE001
        report.data["errors"].append(f"{name}: {traceback.format_exc()}")
        log(f"ERROR in {name}: {traceback.format_exc()}")
    finally:
        scenario.teardown()
        report.save()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--images", required=True, help="directory with busybox.tar and pause.tar")
    ap.add_argument("--trace", action="append", default=[], help="NAME=PATH of a recorded kubelet trace")
    ap.add_argument("--guard", action="store_true", help="run the PSI guard scenario (after the traces)")
    ap.add_argument("--guard-threshold", type=float, default=40.0, help="guard: PSI full avg10 percent")
    ap.add_argument("--guard-interval", type=float, default=1.0, help="guard: the shim's --monitor-interval")
    ap.add_argument("--guard-window", type=float, default=10.0, help="guard: the shim's guard-window setting")
    ap.add_argument("--guard-cooldown", type=float, default=20.0, help="guard: the shim's guard-cooldown setting")
    ap.add_argument("--guard-slack", type=float, default=3.0,
                    help="guard: seconds allowed beyond window + one interval for the guard to act")
    ap.add_argument("--reclaim", action="store_true",
                    help="run the proactive reclaim scenario (after the traces and the guard)")
    ap.add_argument("--classes", choices=("proxy", "nri"), default=None,
                    help="run the classes scenario (e2e/guest_classes.py) after the guard and reclaim scenarios: "
                         "through the proxy, or the proxy then `memqos-shim nri` (containerd's NRI on)")
    ap.add_argument("--pressure", choices=("quick", "full"), default=None,
                    help="run the protection benchmark (e2e/guest_pressure.py): quick (the baseline and the shim's "
                         "default values) or full (every value set)")
    ap.add_argument("--nri", default="", metavar="TRACE",
                    help="run the NRI scenario (e2e/nri_scenario.py) on this trace, after the others; proxy mode's "
                         "values for it are those of the --trace replay of the same file when there is one")
    ap.add_argument("--nri-image", default="", metavar="DIR",
                    help="the NRI scenario's plugin from this image (scripts/build-image's output, e2e/nri_image.py)")
    ap.add_argument("--manifests", default="")
    ap.add_argument("--driver", default="all", help="cgroupfs, systemd or all")
    ap.add_argument("--settle", type=float, default=60.0, help="seconds the reconciler gets to converge")
    ap.add_argument("--stack", default="", help="stack.json of e2e/stacks.py (default: the binaries in PATH)")
    args = ap.parse_args(argv)
    logs = os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    with open(os.path.join(args.out, "guest-started"), "w") as f:
        f.write(f"{time.time()}\n")
    report = Report(args.out)
    stack = load_stack(args.stack)
    report.data["guest"] = guest_facts(stack)
    report.data["stack"] = {
        "name": stack["name"], "source": stack.get("source", "PATH"),
        "containerd": report.data["guest"].get("containerd", ""), "runc": report.data["guest"].get("runc", ""),
        "containerd_version": stack.get("containerd_version", ""), "runc_version": stack.get("runc_version", ""),
        "packages": stack.get("packages", []), "notes": stack.get("notes", []),
        "config": os.path.basename(stack["config"]), "cgroup_driver": "cgroupfs",
        "kernel": report.data["guest"]["kernel"],
    }
    report.data["shim_checkout"] = CHECKOUT
    report.save()
    log(f"guest up: {report.data['guest']}")
    containerd = None
    try:
        setup_cgroups()
        drivers = ["cgroupfs", "systemd"] if args.driver == "all" else [args.driver]
        if "systemd" in drivers:
            ok, why = systemd_usable()
            report.skip("*", "cgroup driver systemd", why if not ok else
                        "the guest runs systemd, but the replay of the (cgroupfs) traces with systemd slice "
                        "parents is not written yet")
            drivers.remove("systemd")
        else:
            report.skip("*", "cgroup driver systemd", "not requested (--driver cgroupfs)")
        if drivers != ["cgroupfs"]:
            raise InfraError(f"no cgroup driver to run (asked: {args.driver})")
        reconciler = reconciler_available(args.python)
        report.data["reconciler"] = {"available": reconciler[0], "reset_help": reconciler[1][-1500:]}
        if not reconciler[0]:
            log("no reconciler in the checkout: pod/QoS/node values will be reported as skipped")
        images = [os.path.join(args.images, n) for n in ("pause.tar", "busybox.tar", "hog.tar")]
        if args.trace or args.guard or args.reclaim or args.nri or args.classes:
            containerd = start_containerd(logs, images, False, report, stack,
                                          nri=bool(args.nri) or args.classes == "nri")
            log("containerd ready, images imported")
        stack_checked: list[bool] = []

        def stack_check() -> None:  # once, with the first pods running
            if not stack_checked:
                stack_checked.append(True)
                check_stack_binaries(report, stack, containerd.pid)

        created_values: dict[str, dict[str, str]] = {}  # trace path -> the values after its "created" step
        for spec in args.trace:
            name, path = spec.split("=", 1)
            scenario = Scenario(args, report, path, name, reconciler)
            scenario.on_running = stack_check
            if args.nri and os.path.realpath(path) == os.path.realpath(args.nri):
                import nri_scenario

                scenario.on_created = lambda scn, p=path: created_values.__setitem__(p, nri_scenario.values(scn))
            run_scenario(name, scenario, report)
        if args.guard:
            guard = GuardScenario(args, report)
            guard.on_running = stack_check
            run_scenario("guard", guard, report)
        if args.reclaim:
            run_scenario("reclaim", ReclaimScenario(args, report), report)
        if args.classes:
            from guest_classes import ClassesScenario
            run_scenario("classes", ClassesScenario(args, report), report)
        if args.pressure:  # no runtime: its cgroups and processes are its own
            run_scenario("pressure", PressureScenario(args, report), report)
        if args.nri:  # last: its pods stay until the VM ends
            import nri_scenario

            def restart_containerd():
                nonlocal containerd
                containerd.terminate()
                containerd.wait(timeout=60)
                containerd = start_containerd(logs, [], False, report, stack, nri=True)
                return containerd

            proxy_values = next((v for p, v in created_values.items()
                                 if os.path.realpath(p) == os.path.realpath(args.nri)), None)
            nri = nri_scenario.NriScenario(args, report, args.nri, reconciler, containerd, restart_containerd,
                                           proxy_values=proxy_values)
            run_scenario("nri", nri, report)
        if not (args.trace or args.guard or args.reclaim or args.nri or args.pressure or args.classes):
            raise InfraError("nothing to run: no --trace, no --guard, no --reclaim, no --pressure")
    except InfraError as e:
        report.data["errors"].append(str(e))
        log(f"INFRA ERROR: {e}")
    except Exception:  # noqa: BLE001
        report.data["errors"].append(traceback.format_exc())
        log(f"ERROR: {traceback.format_exc()}")
    finally:
        failed = sum(1 for c in report.data["checks"] if not c["pass"])
        report.data["status"] = "error" if report.data["errors"] else ("fail" if failed else "pass")
        report.timing("guest-total", time.time() - T0)
        report.save()
        if containerd and containerd.poll() is None:
            containerd.terminate()
            try:
                containerd.wait(timeout=30)
            except subprocess.TimeoutExpired:
                containerd.kill()
    s = report.data["summary"]
    log(f"status {report.data['status']}: {s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped")
    return {"pass": 0, "fail": 1}.get(report.data["status"], 3)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
