"""The PSI guard scenario's phases (e2e/guest_guard.py's GuardScenario): control, guard, restart,
and the checks of each container's end."""
from __future__ import annotations

import json
import os
import signal
import time

from guest_common import (
    CGROOT, MI, SHIM_SOCK, cg_read, log, metric, parse_events, scrape_metrics
)
import expect as X  # e2e/expect.py: independent arithmetic


class GuardPhases:
    """The phases of GuardScenario (its state and helpers are GuardScenario's)."""

    def control(self) -> None:
        step = "control (guard action none)"
        self.start_shim("control", "none", 19464)
        pod = self.create_pod("guard-control", self.TARGET_OOM)
        if self.on_running:
            self.on_running()
        report_rec: dict = {}

        def finished(p: dict, s: dict) -> bool:
            if not report_rec:
                rec = self.audit(p, "guard-report")
                if rec:
                    report_rec.update(rec)
                    log(f"guard: control: guard-report after {rec['time'] - p['t_start']:.1f}s")
            # keep watching for five more intervals past the report: the crawl goes on
            return bool(report_rec) and time.time() >= report_rec["time"] + 5 * self.interval

        self.watch("control", [pod], finished, 150)
        metrics = scrape_metrics(self.metrics_address)
        end = pod["samples"][-1]
        tm = self.timings(pod, report_rec or None)
        hot = self.first(pod, self.is_hot)
        subject = f"{pod['name']}/hog (request 16Mi, limit 96Mi, hog target {pod['target']} MiB)"
        cg = f"{CGROOT}{pod['cg']}"
        self.check(step, subject, f"{cg}/memory.high (at creation: first sample)", self.high,
                   pod["samples"][0].get("high"), "; ".join(f"{k}: {v}" for k, v in self.exp.why.items()))
        self.check(step, subject, f"{cg}/memory.max", X.kernel_reads(self.LIMIT, self.node.page),
                   cg_read(pod["cg"], "memory.max"), "the limit")
        self.check(step, subject, f"{cg}/memory.pressure full avg10 >= threshold while at memory.high",
                   f">= {self.threshold:g}% at some sample", f"max {tm['full_avg10_max']}% "
                   f"({'first at t+' + str(hot['t']) + 's' if hot else 'never with memory.current at memory.high'})",
                   "the crawl as the guard defines it: PSI full avg10 >= threshold, memory.current at memory.high",
                   ok=hot is not None)
        self.check(step, subject, f"{self.shim.audit_log}: guard-report for {pod['id'][:12]}",
                   f"<= {self.deadline:g} s after the crawl began", f"{tm.get('action_after_hot')} s"
                   if report_rec else "no guard-report record",
                   f"window {self.window:g} + interval {self.interval:g} + slack {self.slack:g}", "audit log",
                   ok=bool(report_rec) and hot is not None and tm["action_after_hot"] <= self.deadline)
        relax = self.audit(pod, "guard-relax")
        self.check(step, subject, f"{self.shim.audit_log}: guard-relax for {pod['id'][:12]}", "none",
                   "none" if relax is None else "present", "guard action none writes nothing", "audit log")
        self.check(step, subject, f"{cg}/memory.high (end)", self.high, end.get("high"),
                   "guard action none: memory.high unchanged")
        # far below memory.max: closer to memory.high than to memory.max, and the hog short of its target
        mid = (self.high + self.LIMIT) // 2
        cur = end.get("current")
        self.check(step, subject, f"{cg}/memory.current (end)",
                   f">= {self.at_high} (at memory.high) and < {mid} (halfway memory.high..memory.max)",
                   cur, f"{(cur or 0) / MI:.1f} MiB = {100 * (cur or 0) / self.LIMIT:.0f}% of memory.max, "
                   f"{(end['wall'] - hot['wall']) if hot else 0:.1f} s after the crawl began",
                   ok=cur is not None and self.at_high <= cur < mid)
        self.check(step, subject, f"{pod['log']}: hog progress (end)", f"< {pod['target']} MiB (not done)",
                   f"{end['hog_mib']} MiB", "the hog crawls", "container log", ok=not end["hog_done"])
        if hot:
            ev0, ev1 = hot["events"].get("high", 0), end.get("events", {}).get("high", 0)
            self.check(step, subject, f"{cg}/memory.events high (crawl start -> end)", f"> {ev0}", ev1,
                       "the kernel keeps throttling at memory.high", ok=ev1 > ev0)
            dt = end["wall"] - hot["wall"]
            rate = ((cur or 0) - hot["current"]) / MI / dt if dt > 0 else None
            hog_rate = (end["hog_mib"] - hot["hog_mib"]) / dt if dt > 0 else None
            at_high = self.first(pod, self.is_at_high)
            dt_high = end["wall"] - at_high["wall"]
            tm.update(over_high_seconds=round(dt_high, 2),
                      over_high_rate_mib_s=round(((cur or 0) - at_high["current"]) / MI / dt_high, 3))
            tm.update(crawl_seconds=round(dt, 2), crawl_rate_mib_s=rate and round(rate, 3),
                      hog_rate_mib_s=hog_rate and round(hog_rate, 3),
                      current_at_hot=hot["current"], current_end=cur, hog_mib_at_hot=hot["hog_mib"],
                      hog_mib_end=end["hog_mib"], events_high_at_hot=ev0, events_high_end=ev1)
            if rate and rate > 0:
                tm["projected_seconds_to_memory_max"] = round((self.LIMIT - (cur or 0)) / MI / rate)
        m_full = metric(metrics, "memqos_container_memory_pressure_avg10_ratio", container_id=pod["id"], kind="full")
        m_report = metric(metrics, "memqos_guard_actions_total", action="report")
        self.check(step, "/metrics", f"http://{self.metrics_address}/metrics memqos_guard_actions_total{{action=report}}",
                   "1.0", m_report, "counted from the audit stream", "metrics")
        self.check(step, "/metrics", f"http://{self.metrics_address}/metrics "
                   f"memqos_container_memory_pressure_avg10_ratio{{kind=full,container_id={pod['id'][:12]}}}",
                   f">= {self.threshold / 100:g}", m_full, "the monitor's last sample", "metrics",
                   ok=m_full is not None and m_full >= self.threshold / 100)
        self.data["phases"]["control"] = {
            "pod": pod["id"], "timings": tm, "report_record": report_rec or None,
            "metrics": {"full_avg10_ratio": m_full, "guard_actions_report": m_report,
                        "monitor_sample_duration_seconds": metric(metrics, "memqos_monitor_sample_duration_seconds")}}
        self.note(f"control (action none): memory.high {self.high / MI:.0f} MiB reached at t+{tm['at_high']}s, "
                  f"crawl (full avg10 >= {self.threshold:g}%) from t+{tm['hot']}s, guard-report "
                  f"{tm.get('action_after_hot')}s later; over {tm.get('crawl_seconds')}s of crawl memory.current "
                  f"{(tm.get('current_at_hot') or 0) / MI:.1f} -> {(cur or 0) / MI:.1f} MiB "
                  f"({tm.get('crawl_rate_mib_s')} MiB/s; hog {tm.get('hog_mib_at_hot')} -> {tm.get('hog_mib_end')} MiB), "
                  f"full avg10 max {tm['full_avg10_max']}%; at that rate memory.max is "
                  f"{tm.get('projected_seconds_to_memory_max')}s away")
        self.remove_pod(pod)
        self.stop_shim()

    def guard(self) -> None:
        step = "guard (action relax)"
        self.start_shim("relax", "relax", 19465)
        oom = self.create_pod("guard-oom", self.TARGET_OOM)
        done = self.create_pod("guard-complete", self.TARGET_COMPLETE)
        relaxed: dict[str, dict] = {}

        def finished(p: dict, s: dict) -> bool:
            if p["id"] not in relaxed:
                rec = self.audit(p, "guard-relax")
                if rec:
                    relaxed[p["id"]] = rec
                    log(f"guard: relax of {p['name']} after {rec['time'] - p['t_start']:.1f}s")
            if p is oom:
                st = p["status"]
                from shim.cri import api_pb2 as pb

                return st is not None and st.state == pb.CONTAINER_EXITED
            return p["id"] in relaxed and s["hog_done"] and s.get("high") == "max"

        self.watch("guard", [oom, done], finished, 180)
        metrics = scrape_metrics(self.metrics_address)
        phase: dict = {"metrics": {}}
        for pod in (oom, done):
            rec = relaxed.get(pod["id"])
            tm = self.timings(pod, rec)
            hot = self.first(pod, self.is_hot)
            subject = f"{pod['name']}/hog (request 16Mi, limit 96Mi, hog target {pod['target']} MiB)"
            cg = f"{CGROOT}{pod['cg']}"
            self.check(step, subject, f"{cg}/memory.high (at creation: first sample)", self.high,
                       pod["samples"][0].get("high"), "; ".join(f"{k}: {v}" for k, v in self.exp.why.items()))
            self.check(step, subject, f"{cg}/memory.pressure full avg10 >= threshold while at memory.high",
                       f">= {self.threshold:g}% at some sample", f"max {tm['full_avg10_max']}% "
                       f"({'first at t+' + str(hot['t']) + 's' if hot else 'never with memory.current at memory.high'})",
                       "the crawl as the guard defines it", ok=hot is not None)
            self.check(step, subject, f"{self.shim.audit_log}: guard-relax for {pod['id'][:12]}",
                       f"<= {self.deadline:g} s after the crawl began",
                       f"{tm.get('action_after_hot')} s" if rec else "no guard-relax record",
                       f"window {self.window:g} + interval {self.interval:g} + slack {self.slack:g}", "audit log",
                       ok=bool(rec) and hot is not None and tm["action_after_hot"] <= self.deadline)
            self.check(step, subject, f"{self.shim.audit_log}: guard-relax old -> new", f"{self.high} -> max",
                       f"{rec.get('old')} -> {rec.get('new')}" if rec else "no record", "compare-and-write of memory.high",
                       "audit log")
            after = [s for s in pod["samples"] if rec and s["wall"] >= rec["time"] and not s.get("gone")]
            self.check(step, subject, f"{cg}/memory.high (first sample after guard-relax)", "max",
                       after[0].get("high") if after else "(no sample before the cgroup went away)",
                       f"read {after[0]['wall'] - rec['time']:.2f} s after the record" if after else "")
            at_relax = self.sample_at(pod, rec["time"]) if rec else None
            if at_relax:
                tm.update(current_at_relax=at_relax.get("current"), hog_mib_at_relax=at_relax["hog_mib"])
            if hot and rec:
                dt = rec["time"] - hot["wall"]
                tm["crawl_rate_mib_s"] = round(((at_relax or hot).get("current", 0) - hot["current"]) / MI / dt, 3) \
                    if dt > 0 and (at_relax or hot).get("current") is not None else None
            if pod is oom:
                self.check_oom(step, subject, pod, rec, tm)
            else:
                self.check_complete(step, subject, pod, rec, tm)
            phase[pod["name"]] = {"pod": pod["id"], "timings": tm, "relax_record": rec}
            phase["metrics"][pod["name"]] = {
                "memory_high_bytes": metric(metrics, "memqos_container_memory_high_bytes", container_id=pod["id"]),
                "guard_relaxed": metric(metrics, "memqos_container_guard_relaxed", container_id=pod["id"])}
        m_relax = metric(metrics, "memqos_guard_actions_total", action="relax")
        phase["metrics"]["guard_actions_relax"] = m_relax
        phase["metrics"]["monitor_sample_duration_seconds"] = metric(metrics, "memqos_monitor_sample_duration_seconds")
        self.check(step, "/metrics", f"http://{self.metrics_address}/metrics memqos_guard_actions_total{{action=relax}}",
                   "2.0", m_relax, "one relaxation per crawling container", "metrics")
        m_high = phase["metrics"]["guard-complete"]["memory_high_bytes"]
        self.check(step, "/metrics", f"http://{self.metrics_address}/metrics memqos_container_memory_high_bytes"
                   f"{{container_id={done['id'][:12]}}}", "inf", m_high, "memory.high max shows as +Inf", "metrics")
        self.data["phases"]["guard"] = phase
        self.relaxed_pods = (oom, done)
        self.stop_shim(signal.SIGKILL)  # the restart phase takes over from a shim that had no say

    def restart(self) -> None:
        """The guard phase's shim was killed (-9) with guard-complete relaxed (memory.high max, its
        hog holding 80 MiB). A new shim resumes the episode from the episode file; the hog gives
        its memory back (SIGUSR1); after the cool-down of calm the new shim restores the computed
        memory.high -- a restore on a real kernel, by a shim that did not relax it."""
        step = "restart (guard episode resumed by a new shim)"
        oom, done = self.relaxed_pods
        subject = f"{done['name']}/hog (relaxed by the previous shim, hog holding {done['target']} MiB)"
        cg = f"{CGROOT}{done['cg']}"
        episodes = os.path.join(os.path.dirname(SHIM_SOCK), "guard-episodes.json")
        try:
            saved = json.load(open(episodes))["episodes"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            saved = []
            log(f"guard: restart: {episodes}: {e}")
        entry = next((e for e in saved if e.get("ref", {}).get("id") == done["id"]), None)
        self.check(step, subject, f"{episodes} (after kill -9)", f"relaxed, restore_high {self.high}",
                   f"{entry['mode']}, restore_high {entry['restore_high']}" if entry else "no entry",
                   "written by the guard phase's shim when it relaxed the container", "episode file")
        self.check(step, subject, f"{cg}/memory.high (before the new shim)", "max", cg_read(done["cg"], "memory.high"),
                   "nobody restored it while no shim ran")
        self.start_shim("restart", "relax", 19466)
        t_shim = time.time()
        pids = [int(x) for x in cg_read(done["cg"], "cgroup.procs").split()]
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        t_free = time.time()
        log(f"guard: restart: new shim up, SIGUSR1 to the hog ({pids}): it gives its memory back")
        restored: dict = {}

        def finished(p: dict, s: dict) -> bool:
            if not restored:
                rec = self.audit(p, "guard-restore")
                if rec:
                    restored.update(rec)
            return bool(restored) and s.get("high") not in (None, "max")

        limit = self.cooldown + 4 * self.interval + self.slack + 30
        done["finished"] = False  # watched again, from the guard phase's end
        done.pop("timed_out", None)
        self.watch("restart", [done], finished, limit)
        resume = self.audit(done, "guard-resume")
        self.check(step, subject, f"{self.shim.audit_log}: guard-resume for {done['id'][:12]}",
                   f"mode relaxed, restore_high {self.high}",
                   f"mode {resume.get('mode')}, restore_high {resume.get('restore_high')}" if resume else "no record",
                   "the new shim took the episode over", "audit log")
        gone = self.audit(oom, "guard-resume")
        self.check(step, f"{oom['name']}/hog (OOM-killed: its cgroup is gone)",
                   f"{self.shim.audit_log}: guard-resume for {oom['id'][:12]}", "none",
                   "none" if gone is None else "present", "an episode of a container that is gone is dropped",
                   "audit log")
        freed = (done.get("hog") or {}).get("freed_wall")
        # calm began: the first sample after the resume and the free that meets the guard's own
        # calm condition (PSI full avg10 below half the threshold -- avg10 still decays from the
        # crawl for several seconds -- and memory.current below memory.high minus the margin)
        start = max(resume["time"] if resume else t_shim, freed or t_free)
        calm = next((x for x in done["samples"] if x["wall"] >= start and x.get("full") is not None
                     and x["full"] < self.threshold / 2 and x.get("current") is not None
                     and x["current"] < self.at_high), None)
        calm_from = calm["wall"] if calm else start
        after = round(restored["time"] - calm_from, 2) if restored else None
        bound = self.cooldown + 2 * self.interval + self.slack
        self.check(step, subject, f"{self.shim.audit_log}: guard-restore for {done['id'][:12]}",
                   f"{self.cooldown - self.interval:g} s .. {bound:g} s after calm began "
                   f"({round(calm_from - start, 2) if calm else 'never'} s after resume and free)",
                   f"{after} s, old {restored.get('old')} -> new {restored.get('new')}" if restored else "no record",
                   f"cool-down {self.cooldown:g} restarted by the new shim + 2 intervals + slack {self.slack:g}",
                   "audit log", ok=bool(restored) and self.cooldown - self.interval <= after <= bound
                   and restored.get("old") == "max" and restored.get("new") == str(self.high))
        end = done["samples"][-1] if done["samples"] else {}
        self.check(step, subject, f"{cg}/memory.high (after guard-restore)", self.high, end.get("high"),
                   "the computed value, written back by the new shim")
        self.check(step, subject, f"{cg}/memory.current (after SIGUSR1)", f"< {self.at_high}", end.get("current"),
                   "the hog gave its memory back: calm", ok=end.get("current") is not None
                   and end["current"] < self.at_high)
        left = json.load(open(episodes))["episodes"] if os.path.exists(episodes) else []
        self.check(step, subject, f"{episodes} (after the restore)", "no episode", f"{len(left)} episode(s)",
                   "the episode is over", "episode file", ok=not left)
        self.data["phases"]["restart"] = {"pod": done["id"], "resume_record": resume, "restore_record": restored or None,
                                          "restore_after_calm": after, "freed_wall": freed,
                                          "calm_after_resume_and_free": calm and round(calm_from - start, 2)}
        self.note(f"restart: the relaxing shim killed -9; a new shim resumed the episode of {done['name']} "
                  f"(guard-resume, restore_high {self.high / MI:.0f} MiB), the hog freed its memory, and the new "
                  f"shim restored memory.high {after}s after calm began (cool-down {self.cooldown:g}s)")
        self.stop_shim()

    def check_oom(self, step: str, subject: str, pod: dict, rec: dict | None, tm: dict) -> None:
        """Relaxed, the hog runs into memory.max: the kernel OOM-kills it. Its cgroup goes away
        with the task (containerd deletes it on exit), so oom_kill is read from the pod cgroup
        (memory.events is hierarchical) and, when a sample caught it, from the container's."""
        st = self.status(pod)
        pod["status"] = st
        from shim.cri import api_pb2 as pb

        pod_events = parse_events(cg_read(pod["parent"], "memory.events"))
        self.check(step, subject, f"{CGROOT}{pod['parent']}/memory.events oom_kill (pod: hierarchical)", ">= 1",
                   pod_events.get("oom_kill"), "killed at memory.max", ok=(pod_events.get("oom_kill") or 0) >= 1)
        seen = [s["events"].get("oom_kill", 0) for s in pod["samples"] if s.get("events")]
        self.check(step, subject, f"ContainerStatus {pod['id'][:12]} state/exit_code/reason",
                   "CONTAINER_EXITED/137/OOMKilled",
                   f"{pb.ContainerState.Name(st.state)}/{st.exit_code}/{st.reason}", "the runtime saw the OOM kill",
                   "CRI ContainerStatus")
        hog = pod.get("hog") or {}
        last = hog.get("mib", 0)
        limit_mib = self.LIMIT // MI
        self.check(step, subject, f"{pod['log']}: last MiB touched", f"> {self.high // MI} and <= {limit_mib}",
                   f"{last} MiB", "past memory.high once relaxed, never past memory.max", "container log",
                   ok=self.high // MI < last <= limit_mib)
        exited = self.first(pod, lambda s: s.get("state") == pb.CONTAINER_EXITED or s.get("gone"))
        tm.update(container_oom_kill_seen=max(seen, default=None), pod_oom_kill=pod_events.get("oom_kill"),
                  hog_mib_last=last, exit_code=st.exit_code, reason=st.reason,
                  gone_or_exited=exited and exited["t"])
        if rec and hog.get("wall"):
            tm["last_step_after_relax"] = round(hog["wall"] - rec["time"], 2)
        self.note(f"{pod['name']} (target {pod['target']} MiB > limit): memory.high reached at t+{tm['at_high']}s, "
                  f"crawl from t+{tm['hot']}s, guard-relax {tm.get('action_after_hot')}s later "
                  f"(memory.current {(tm.get('current_at_relax') or 0) / MI:.1f} MiB, hog at "
                  f"{tm.get('hog_mib_at_relax')} MiB, crawl {tm.get('crawl_rate_mib_s')} MiB/s); then the hog reached "
                  f"{last} MiB {tm.get('last_step_after_relax')}s after the relax and was OOM-killed "
                  f"(exit {st.exit_code} {st.reason}, pod memory.events oom_kill {pod_events.get('oom_kill')})")

    def check_complete(self, step: str, subject: str, pod: dict, rec: dict | None, tm: dict) -> None:
        hog = pod.get("hog") or {}
        end = pod["samples"][-1]
        cg = f"{CGROOT}{pod['cg']}"
        self.check(step, subject, f"{pod['log']}: hog done", f"done {pod['target']} MiB",
                   f"{'done' if hog.get('done') else 'not done'} {hog.get('mib')} MiB", "the target fits below memory.max",
                   "container log", ok=hog.get("done") and hog.get("mib") == pod["target"])
        cur = end.get("current")
        self.check(step, subject, f"{cg}/memory.current (after done)",
                   f">= {pod['target'] * MI} and <= {self.LIMIT}", cur, "the hog's memory is charged in full",
                   ok=cur is not None and pod["target"] * MI <= cur <= self.LIMIT)
        self.check(step, subject, f"{cg}/memory.events oom_kill", "0", end.get("events", {}).get("oom_kill"),
                   "completed below memory.max")
        st = self.status(pod)
        from shim.cri import api_pb2 as pb

        self.check(step, subject, f"ContainerStatus {pod['id'][:12]} state", "CONTAINER_RUNNING",
                   pb.ContainerState.Name(st.state), "the hog sleeps after its target", "CRI ContainerStatus")
        if rec and hog.get("done_wall"):
            tm["done_after_relax"] = round(hog["done_wall"] - rec["time"], 2)
        tm.update(current_end=cur, hog_mib_end=hog.get("mib"))
        self.note(f"{pod['name']} (target {pod['target']} MiB < limit): memory.high reached at t+{tm['at_high']}s, "
                  f"crawl from t+{tm['hot']}s, guard-relax {tm.get('action_after_hot')}s later "
                  f"(memory.current {(tm.get('current_at_relax') or 0) / MI:.1f} MiB, hog at "
                  f"{tm.get('hog_mib_at_relax')} MiB, crawl {tm.get('crawl_rate_mib_s')} MiB/s); done "
                  f"{tm.get('done_after_relax')}s after the relax, memory.current {(cur or 0) / MI:.1f} MiB, "
                  f"memory.high {end.get('high')}")
