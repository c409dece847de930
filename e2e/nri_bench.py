"""The NRI scenario's latency bench (e2e/nri_scenario.py, its last step): what CreateContainer
costs at containerd's CRI socket with `memqos-shim nri` registered, with no plugin, and through
proxy mode (`memqos-shim serve` in front of the same containerd), in the same VM boot.

One pod (a copy of the trace's qos-burstable-limit pod, so every create gets a real decision),
then ROUNDS rounds of PER_BLOCK creates per mode: a block with the plugin registered, the plugin
stopped (SIGTERM: containerd drops it), a block with no plugin and a block through the proxy
(in turn one first, then the other), the plugin started again and synchronized. Each create is
timed from the client's call to its reply, then the container is removed (not timed). The
plugin's own time per create is the audit record's ``handler_us`` (from the call reaching the
handler to its record). Under TCG every figure is inflated several times: the report puts the
modes side by side (medians, added time, ratios), which is what carries over to a real node.
No figure is asserted; the checks are that every create succeeded and was audited. Every
timed create is kept (``calls``: round, index in its block, seconds since the guest's start
``t0`` (epoch seconds), milliseconds) and the slowest three per mode are named in the summary, so
a tail can be matched with the plugin's log (its per-call lines at ``--log-level debug``).
"""
from __future__ import annotations

import math
import signal
import time

from guest_common import Cri, SHIM_SOCK, Shim, T0, read_audit

ROUNDS = 3
PER_BLOCK = 25
MODES = ("none", "nri", "proxy")
LABEL = {"none": "no plugin", "nri": "NRI plugin", "proxy": "proxy mode"}


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of ``values``; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize(samples: dict[str, list[float]], handler_us: list[int]) -> dict:
    """Per mode n / p50 / p99 (ms), what the plugin and the proxy add over no plugin (ms and the
    ratio of medians), and the plugin handler's own time (µs)."""
    out: dict = {"modes": {}, "added": {}, "handler_us": {}}
    for mode in MODES:
        xs = samples.get(mode, [])
        out["modes"][mode] = {"n": len(xs), "p50_ms": _r(percentile(xs, 50)), "p99_ms": _r(percentile(xs, 99))}
    base = out["modes"]["none"]
    for mode in ("nri", "proxy"):
        m = out["modes"][mode]
        if base["p50_ms"] is None or m["p50_ms"] is None:
            continue
        out["added"][mode] = {"p50_ms": _r(m["p50_ms"] - base["p50_ms"]), "p99_ms": _r(m["p99_ms"] - base["p99_ms"]),
                              "p50_ratio": round(m["p50_ms"] / base["p50_ms"], 3) if base["p50_ms"] else None}
    out["handler_us"] = {"n": len(handler_us), "p50": percentile(handler_us, 50), "p99": percentile(handler_us, 99)}
    return out


def slowest(calls: list[list], n: int = 3) -> list[list]:
    """The ``n`` slowest of one mode's calls ([round, index, at, ms]), slowest first."""
    return sorted(calls, key=lambda c: -c[3])[:n]


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def summary_lines(result: dict) -> list[str]:
    """The bench as the report's summary lines (scripts/e2e-vm prints them as `NRI ...`)."""
    modes, added, h = result["modes"], result["added"], result["handler_us"]
    lines = [f"latency: CreateContainer at containerd's CRI socket, {result['rounds']} rounds x "
             f"{result['per_block']} per mode in alternating blocks (TCG: compare modes, not absolutes)"]
    for mode in MODES:
        m = modes[mode]
        line = f"latency: {LABEL[mode]:<10} n={m['n']:<3} p50 {m['p50_ms']} ms  p99 {m['p99_ms']} ms"
        if mode in added:
            a = added[mode]
            line += f"  added p50 {a['p50_ms']:+} ms, p99 {a['p99_ms']:+} ms, p50 x{a['p50_ratio']}"
        lines.append(line)
    lines.append(f"latency: the plugin's handler (audit handler_us) n={h['n']} p50 {h['p50']} us  p99 {h['p99']} us")
    for mode, calls in result.get("slowest", {}).items():
        if calls:
            lines.append(f"latency: {LABEL[mode]:<10} slowest: " + ", ".join(
                f"{ms} ms (round {r + 1} call {i + 1}, t+{at:.1f}s)" for r, i, at, ms in calls))
    return lines


class Bench:
    """Runs on an NriScenario after its other steps (the plugin registered, the pods running)."""

    def __init__(self, nri, rounds: int = ROUNDS, per_block: int = PER_BLOCK):
        self.s = nri
        self.rounds, self.per_block = rounds, per_block
        self.samples: dict[str, list[float]] = {m: [] for m in MODES}
        self.errors: dict[str, list[str]] = {m: [] for m in MODES}
        # every timed create: [round, index in its block, seconds since the guest's start, ms]
        self.calls: dict[str, list[list]] = {m: [] for m in MODES}
        self.round = 0
        self.seq = 0

    def block(self, mode: str, cri, template) -> None:
        from shim.cri import api_pb2 as pb

        for i in range(self.per_block):
            req = pb.CreateContainerRequest()
            req.CopyFrom(template)
            self.seq += 1
            req.config.metadata.name = f"bench-{mode}-{self.seq}"
            self.s.nri.replayer._prepare_host("CreateContainer", req)
            at = time.time() - T0
            t = time.perf_counter()
            try:
                created = cri.call("CreateContainer", req)
            except Exception as e:  # noqa: BLE001 - counted, reported, the bench goes on
                self.errors[mode].append(str(e)[:200])
                continue
            ms = (time.perf_counter() - t) * 1000
            self.samples[mode].append(ms)
            self.calls[mode].append([self.round, i, round(at, 3), round(ms, 2)])
            try:
                self.s.nri.direct.call("RemoveContainer", pb.RemoveContainerRequest(container_id=created.container_id))
            except Exception as e:  # noqa: BLE001
                self.errors[mode].append(f"RemoveContainer: {str(e)[:200]}")

    def run(self) -> dict:
        from shim.cri import api_pb2 as pb

        s = self.s
        t_all = time.time()
        run_req, create_req = s.clone_pod("bead", "-bench")
        s.nri.replayer._prepare_host("RunPodSandbox", run_req)
        sandbox = s.nri.direct.call("RunPodSandbox", run_req)
        create_req.pod_sandbox_id = sandbox.pod_sandbox_id
        proxy = Shim(s.args.python, s.logs, "nri-bench-proxy", s.nri.kubelet_config,
                     s.plugin.args[s.plugin.args.index("--meminfo") + 1])
        proxy.start()
        proxy_cri = Cri(SHIM_SOCK)
        proxy_cri.call("Version", pb.VersionRequest())  # the channel connected before any timing
        clients = {"none": s.nri.direct, "nri": s.nri.direct, "proxy": proxy_cri}
        audited_before = len(self.handler_records())
        try:
            for r in range(self.rounds):
                self.round = r
                self.block("nri", clients["nri"], create_req)
                s.plugin.signal(signal.SIGTERM)
                time.sleep(1)  # containerd notices the closed connection
                for mode in (("none", "proxy") if r % 2 == 0 else ("proxy", "none")):
                    self.block(mode, clients[mode], create_req)
                if r < self.rounds - 1:
                    syncs = len(s.plugin.events("nri-synchronize"))
                    s.plugin.start()
                    s.plugin.wait_synced(syncs + 1)
        finally:
            proxy_cri.close()
            proxy.kill(signal.SIGTERM)
        handler = [r["handler_us"] for r in self.handler_records()[audited_before:] if "handler_us" in r]
        result = summarize(self.samples, handler)
        result.update(rounds=self.rounds, per_block=self.per_block, seconds=round(time.time() - t_all, 1),
                      errors={m: e[:5] for m, e in self.errors.items() if e}, calls=self.calls, t0=T0,
                      slowest={m: slowest(c) for m, c in self.calls.items()})
        want = self.rounds * self.per_block
        for mode in MODES:
            s.check("latency bench", f"CreateContainer through {LABEL[mode]}", "CRI CreateContainer", str(want),
                    str(len(self.samples[mode])), "every timed create succeeded "
                    f"(errors: {self.errors[mode][:2]})", "CRI")
        s.check("latency bench", "the plugin's CreateContainer records with handler_us", "nri-audit.jsonl",
                str(want), str(len(handler)), "one audited decision per create through the plugin", "audit")
        return result

    def handler_records(self) -> list[dict]:
        return [r for r in read_audit(self.s.plugin.audit_log)
                if r.get("method") == "CreateContainer" and str(r.get("container", "")).startswith("bench-nri-")]
