"""The shim's own checks: upstream runtime, listening socket, audit log, guard, metrics, reclaim."""
from __future__ import annotations

import os
import stat

from shim.tools.doctor.common import (
    FAIL,
    MIN_KERNEL_RECLAIM,
    PASS,
    WARN,
    CheckBase,
    Result,
    kernel_version,
    rpc_error,
    runtime_version,
)


class ShimChecks(CheckBase):
    """Upstream, socket, audit log, guard, metrics, reclaim."""

    # sockets
    def check_upstream(self) -> Result:
        from shim.transport.endpoints import socket_path

        name = "upstream"
        up = self.cfg.upstream
        try:
            path = socket_path(up)
        except ValueError as e:
            return Result(name, FAIL, str(e))
        if not os.path.exists(path):
            return Result(name, FAIL, f"no socket at {path}: is the runtime (containerd / CRI-O) running?")
        try:
            rname, rver, api = runtime_version(up, self.env.rpc_timeout)
        except Exception as e:
            return Result(name, FAIL, f"{up} does not answer CRI Version: {rpc_error(e)}")
        return Result(name, PASS, f"{up} answers: {rname} {rver} (CRI {api})")

    def check_socket(self) -> Result:
        from shim.transport.endpoints import socket_path

        name = "shim socket"
        path = socket_path(self.cfg.listen)
        parent = os.path.dirname(path)
        notes = []
        verdict = PASS
        try:
            pst = os.stat(parent)
            if pst.st_mode & 0o002 and not pst.st_mode & stat.S_ISVTX:
                verdict = FAIL
                notes.append(f"{parent} is world-writable without the sticky bit: anyone can replace the socket")
        except FileNotFoundError:
            return Result(name, WARN, f"{parent} does not exist: the shim is not running (it creates it at start)")
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return Result(name, WARN if verdict == PASS else verdict,
                          f"no socket at {path}: the shim is not running (or listens elsewhere)", notes)
        if not stat.S_ISSOCK(st.st_mode):
            return Result(name, FAIL, f"{path} exists and is not a socket", notes)
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o007:
            verdict = FAIL
            notes.append(f"mode {mode:04o} lets every user drive the runtime through the shim (root-equivalent)")
        if mode & 0o070 and not self.cfg.socket_group:
            verdict = FAIL if verdict == FAIL else WARN
            notes.append(f"mode {mode:04o} grants a group access although no --socket-group is configured")
        if st.st_uid != 0:
            verdict = FAIL if verdict == FAIL else WARN
            notes.append(f"owned by uid {st.st_uid}, not root")
        try:
            rname, rver, _ = runtime_version(self.cfg.listen, self.env.rpc_timeout)
            answer = f"answers Version through the shim: {rname} {rver}"
        except Exception as e:
            answer = f"does not answer Version: {rpc_error(e)}"
            verdict = FAIL if verdict == FAIL else WARN
        return Result(name, verdict, f"{path} mode {mode:04o} uid {st.st_uid} gid {st.st_gid}; {answer}", notes)

    # audit, guard, metrics
    def check_audit_log(self) -> Result:
        name = "audit log"
        target = self.cfg.audit_log
        if target is None:
            return Result(name, WARN, "none: rewrites, cgroup writes and guard actions leave no record")
        if target == "-":
            return Result(name, PASS, "stdout (the journal under systemd)")
        if os.path.isdir(target):
            return Result(name, FAIL, f"{target} is a directory")
        if os.path.exists(target):
            if os.access(target, os.W_OK):
                return Result(name, PASS, f"{target} is writable")
            return Result(name, FAIL, f"{target} is not writable by uid {os.geteuid()}")
        parent = os.path.dirname(os.path.abspath(target))
        if not os.path.isdir(parent):
            return Result(name, WARN, f"{parent} does not exist (the systemd unit's LogsDirectory= creates "
                                      "/var/log/memqos-shim when it starts; otherwise the shim cannot start)")
        if os.access(parent, os.W_OK | os.X_OK):
            return Result(name, PASS, f"{target} does not exist yet; {parent} is writable")
        return Result(name, FAIL, f"{parent} is not writable by uid {os.geteuid()}: the shim cannot create {target}")

    def check_guard(self) -> Result:
        name = "memory.high guard"
        interval = self.cfg.monitor_interval
        if not interval:
            return Result(name, WARN, "off (--monitor-interval 0): crawling containers are neither relaxed nor reported")
        desc = (f"action {self.cfg.guard_action}: full avg10 >= {self.cfg.guard_threshold:g}% for "
                f"{self.cfg.guard_window:g} s at memory.high; restore after {self.cfg.guard_cooldown:g} s calm; "
                f"sampled every {interval:g} s")
        details, problems = self._guard_episodes()
        try:
            _, owners, _ = self._ownership()
        except Exception:  # the ownership check reports its own failure
            owners = None
        if owners is not None and owners.owner("container memory.high") == "kubelet" and self.cfg.guard_action == "relax":
            return Result(name, WARN, desc, [
                f"the kubelet owns container memory.high ({owners.reasons['container memory.high']}): serve's guard",
                "reports crawling containers instead of relaxing them (relaxing would fight the kubelet)"] + details)
        if self.cfg.guard_action == "none":
            return Result(name, WARN, desc, ["report only: a container past memory.high keeps crawling"] + details)
        if self.cfg.guard_window < 2 * interval:
            return Result(name, WARN, desc, ["the window is shorter than two samples: one sample decides"] + details)
        if problems:
            return Result(name, WARN, desc, problems + details)
        return Result(name, PASS, desc, details)

    def _guard_episodes(self) -> tuple[list[str], list[str]]:
        """(details, problems): where open guard episodes are kept and which are open now."""
        from shim.guard.monitor import episode_file

        try:
            episodes = episode_file(self.cfg)
        except ValueError as e:
            return [], [f"guard state: {e}"]
        if episodes is None:
            return ["episodes in memory only (guard-state: none): a restart leaves relaxed containers at max"], []
        found = episodes.load()
        details = [f"episodes kept in {episodes.path}: {len(found)} open"]
        for e in found[:10]:
            r = e.ref
            what = f"restore {e.restore_high}" if e.restore_high else "reported"
            details.append(f"  {e.mode}: {r['namespace']}/{r['pod']}/{r['container']} ({r['id'][:12]}), {what}")
        if len(found) > 10:
            details.append(f"  ... and {len(found) - 10} more")
        problems = [f"{episodes.path}: {episodes.problem}"] if episodes.problem else []
        return details, problems

    def check_metrics(self) -> Result:
        from shim.evidence.metrics import is_loopback, split_address

        addr = self.cfg.metrics_address
        if not addr:
            return Result("metrics", PASS, "off (--metrics-address not set)")
        host, _ = split_address(addr)
        if not is_loopback(host):
            return Result("metrics", WARN, f"{addr}: reachable from the network; the series name pods and containers")
        return Result("metrics", PASS, f"http://{addr}/metrics (loopback only)")


    def reclaim_file(self) -> tuple[str | None, str]:
        """(a memory.reclaim found in a non-root cgroup, or None; where it looked)."""
        from shim.node.facts import is_cgroup_v2

        root = self.cfg.cgroup_root
        if not is_cgroup_v2(root):
            return None, f"{root} is not cgroup v2"
        places = []
        try:
            on_disk, driver = self._driver()
            from shim.effects.layout import CgroupLayout

            places.append(CgroupLayout(driver, self.kubelet.cgroup_root).kubepods)
        except Exception:  # noqa: BLE001 -- any non-root cgroup will do
            pass
        try:
            places += sorted(n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n)))
        except OSError:
            pass
        for rel in places:
            path = os.path.join(root, rel, "memory.reclaim")
            if os.path.isfile(path):
                return path, rel
        return None, f"no non-root cgroup under {root} has memory.reclaim" if places else f"no cgroup below {root}"

    def check_reclaim(self) -> Result:
        name = "proactive reclaim"
        path, where = self.reclaim_file()
        v = kernel_version(self.env.kernel_release())
        old = v is not None and v < MIN_KERNEL_RECLAIM
        avail = f"memory.reclaim available ({path})" if path else (
            f"memory.reclaim not available: {where}" + (" (kernel older than 5.19)" if old else ""))
        if not self.cfg.reclaim:
            return Result(name, PASS, f"off (--reclaim false, the default); {avail}")
        from shim.decision.quantity import format_bytes

        c = self.cfg
        desc = (f"on: within {c.reclaim_headroom:g}% (at least {format_bytes(c.reclaim_headroom_min)}) of memory.high, "
                f"at most {format_bytes(c.reclaim_step)} per write and {format_bytes(c.reclaim_rate)}/s per container, "
                f"while PSI some avg10 < {c.reclaim_psi_some:g}%; {avail}")
        if not c.monitor_interval:
            return Result(name, WARN, desc, ["--monitor-interval 0: the monitor does not run, so neither does reclaim"])
        if path is None:
            return Result(name, WARN, desc, ["the shim will find no memory.reclaim, audit one reclaim-error and "
                                             "stop reclaiming; memory.reclaim needs cgroup v2 and a 5.19 or newer kernel"])
        return Result(name, PASS, desc)
