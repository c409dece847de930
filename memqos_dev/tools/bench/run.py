"""One benchmark run (fresh processes, every measurement) and the medians over runs."""
from __future__ import annotations

import asyncio
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Callable

from memqos_dev.tools.bench.load import Client, load_calls, quick_under_slow, replay_calls, throughput
from memqos_dev.tools.bench.processes import Processes, proc_cpu_precise_s, proc_cpu_s, proc_rss_mib
from shim.cri.methods import CREATE_CONTAINER, EXEC_SYNC, RUN_POD_SANDBOX, VERSION
from memqos_dev.tools.bench.workload import (
    REPLAY_SLICE_SECONDS,
    kubelet_sized_create,
    REPO,
    MiB,
    Sizes,
    exec_request,
    padded,
    pct,
    prepare,
    replay_schedule,
    replay_slices,
)


# the measurements of a run, in the order they run (scripts/bench --only NAME,...)
PARTS = ("small", "reply200k", "throughput", "load", "quick", "replay", "reply16m", "create", "back-to-back",
         "defaults")


def one_run(sizes: Sizes, trace: Path | None, log: Callable[[str], None], parts: tuple[str, ...] = PARTS,
            serve_defaults: bool = False, sources: dict[str, tuple[str, Path]] | None = None) -> dict:
    """One run with fresh processes: the shims of ``sources`` (name -> (transport, checkout);
    default: this checkout's relay)."""
    procs = Processes([], sources or {"relay": ("relay", REPO)}, serve_defaults=serve_defaults)
    procs.start()
    client = None
    try:
        targets = procs.targets()
        client = Client(targets)
        client.wait_ready()
        shims = {t: p.pid for t, p in procs.shims.items()}
        m: dict[str, dict[str, float]] = {name: {} for name in targets}
        w = prepare(targets["direct"], sizes, trace)
        client.alternate(VERSION, lambda i, n: b"", 200)  # warm up every path
        time.sleep(0.3)
        for t, pid in shims.items():
            m[t]["rss_idle_mib"] = proc_rss_mib(pid)

        if "small" in parts:
            log("  small calls")
            cpu0 = {t: proc_cpu_s(pid) for t, pid in shims.items()}
            lat = client.alternate(VERSION, lambda i, n: b"", sizes.small)
            cpu1 = {t: proc_cpu_s(pid) for t, pid in shims.items()}
            for name, v in lat.items():
                m[name]["small_p50_us"] = pct(v, 50) * 1e6
                m[name]["small_p99_us"] = pct(v, 99) * 1e6
            for t in shims:
                m[t]["cpu_ms_per_1000"] = (cpu1[t] - cpu0[t]) * 1000.0 / sizes.small * 1000.0

        if "reply200k" in parts:
            log("  200 KB replies")
            req200 = exec_request(w.exec_container, 200 * 1024)
            lat = client.alternate(EXEC_SYNC, lambda i, n: req200, sizes.reply200k)
            for name, v in lat.items():
                m[name]["reply200k_p50_us"] = pct(v, 50) * 1e6

        if "throughput" in parts:
            log("  throughput, 32 callers")
            for name, cps in throughput(client, sizes).items():
                m[name]["throughput32_cps"] = cps

        if "load" in parts:
            for t, pid in shims.items():
                log(f"  {sizes.load_calls} calls through {t}")
                first = sizes.load_calls // 5
                load_calls(targets[t], client.opts, first)
                m[t]["rss_20k_mib"] = proc_rss_mib(pid)
                c0 = proc_cpu_s(pid)
                t0 = time.perf_counter()
                load_calls(targets[t], client.opts, sizes.load_calls - first)
                dt = time.perf_counter() - t0
                m[t]["load_cpu_ms_per_1000"] = (proc_cpu_s(pid) - c0) * 1e6 / (sizes.load_calls - first)
                m[t]["load_cps"] = (sizes.load_calls - first) / dt
                m[t]["rss_100k_mib"] = proc_rss_mib(pid)
                m[t]["rss_growth_mib"] = m[t]["rss_100k_mib"] - m[t]["rss_20k_mib"]

        if "quick" in parts:
            log("  quick call with 100 slow calls in flight")
            for name, target in targets.items():
                lat = asyncio.run(quick_under_slow(target, client.opts, sizes.quick_calls))
                m[name]["quick_under_slow_p50_ms"] = pct(lat, 50) * 1e3
                m[name]["quick_under_slow_max_ms"] = max(lat) * 1e3

        if "replay" in parts:
            log(f"  kubelet-like load, {sizes.replay_pods} pods (call mix: {w.rates_source})")
            schedule = replay_schedule(w, sizes.replay_pods, sizes.replay_seconds)
            m["direct"]["replay_calls_per_s"] = len(schedule) / sizes.replay_seconds
            # the schedule in 1 s slices, each replayed through every target in turn (the order
            # rotating): drift on the machine hits all targets alike, as in the alternating tests
            slices = replay_slices(schedule, REPLAY_SLICE_SECONDS)
            lats: dict[str, list[float]] = {name: [] for name in targets}
            cpu = {name: 0.0 for name in targets}
            wall = {name: 0.0 for name in targets}
            names = list(targets)
            for k, part in enumerate(slices):
                for name in names[k % len(names):] + names[:k % len(names)]:
                    pid = shims.get(name)
                    c0 = proc_cpu_s(pid) if pid else 0.0
                    t0 = time.perf_counter()
                    lats[name] += asyncio.run(replay_calls(targets[name], client.opts, part))
                    wall[name] += time.perf_counter() - t0
                    if pid:
                        cpu[name] += proc_cpu_s(pid) - c0
            for name in targets:
                m[name]["replay_p50_us"] = pct(lats[name], 50) * 1e6
                if name in shims:
                    m[name]["replay_cpu_pct"] = cpu[name] / wall[name] * 100.0

        if "reply16m" in parts:
            log("  16 MiB replies")
            req16 = exec_request(w.exec_container, 16 * MiB)
            lat = client.alternate(EXEC_SYNC, lambda i, n: req16, sizes.reply16m, timeout=60)
            for name, v in lat.items():
                m[name]["reply16m_p50_ms"] = pct(v, 50) * 1e3

        if "create" in parts:
            log("  CreateContainer (rewritten) against a passthrough call of the same size")
            template = w.create_template
            size = template.ByteSize()
            pad = padded(size)
            counter = [0]

            def create_req(i: int, name: str) -> bytes:
                counter[0] += 1
                template.config.metadata.attempt = counter[0]
                return template.SerializeToString()

            lat_create = client.alternate(CREATE_CONTAINER, create_req, sizes.creates)
            lat_pad = client.alternate(VERSION, lambda i, n: pad, sizes.creates)
            for name in targets:
                m[name]["create_p50_us"] = pct(lat_create[name], 50) * 1e6
                m[name]["passthrough_same_size_p50_us"] = pct(lat_pad[name], 50) * 1e6
            m["direct"]["create_request_bytes"] = float(size)
            m["direct"]["hook_rewrite_us"] = hook_cost(template, sizes.creates)

        if "back-to-back" in parts:
            log("  back to back: ~4 KB CreateContainer (rewritten) and a passthrough call of the same size")
            back_to_back(client, w.large_create, shims, sizes, m)

        time.sleep(1.5)
        for t, pid in shims.items():
            m[t]["rss_end_mib"] = proc_rss_mib(pid)
        for t in shims:
            if "defaults" in parts and procs.sources[t][1] == REPO:
                m[t]["rss_defaults_mib"] = procs.defaults_rss(procs.sources[t][0])
            if procs.shims[t].poll() is not None:
                raise RuntimeError(f"shim ({t}) died during the run")
        return derive(m)
    finally:
        if client is not None:
            client.close()
        procs.stop()


def back_to_back(client: Client, template, shims: dict[str, int], sizes: Sizes, m: dict[str, dict[str, float]]) -> None:
    """One client sending CreateContainer calls of about 4 KB (rewritten by the shim) back to back,
    then a passthrough call of the same size back to back, each against every target in turn
    (blocks of ``sizes.back_to_back_block`` calls): what the shim does after an answer, and before
    the next call, shows in the next call's latency and in the shim's CPU per call."""
    from shim.cri import pb
    from shim.tools.kubelet_requests import sandbox_config

    size = template.ByteSize()
    pad = padded(size)
    counter = [0]

    def create_req(i: int, name: str) -> bytes:
        """A create in a pod of its own (as most pods have one container), the pod started
        through the same target before the block (so the shim knows it)."""
        counter[0] += 1
        uid = f"b2b{counter[0]:029x}"
        sandbox = sandbox_config(f"b2b-{counter[0]}", uid, "burstable")
        answer = client.unary(name, RUN_POD_SANDBOX)(pb.RunPodSandboxRequest(config=sandbox).SerializeToString(),
                                                     timeout=30)
        sid = pb.RunPodSandboxResponse.FromString(answer).pod_sandbox_id
        return kubelet_sized_create(sid, sandbox, "app").SerializeToString()

    cpu_s = {t: partial(proc_cpu_precise_s, pid) for t, pid in shims.items()}
    n, block = sizes.back_to_back, sizes.back_to_back_block
    kinds = {"create": (CREATE_CONTAINER, create_req), "passthrough": (VERSION, lambda i, name: pad)}
    client.back_to_back(kinds, min(n, 2 * block), block, cpu_s)  # warm up
    lat, cpu = client.back_to_back(kinds, n, block, cpu_s)
    lat_create, lat_pad, cpu_create, cpu_pad = lat["create"], lat["passthrough"], cpu["create"], cpu["passthrough"]
    for name in lat_create:
        m[name]["b2b_create_p50_us"] = pct(lat_create[name], 50) * 1e6
        m[name]["b2b_passthrough_p50_us"] = pct(lat_pad[name], 50) * 1e6
    for t in shims:
        m[t]["b2b_cpu_ms_per_create"] = cpu_create[t] * 1e3 / n
        m[t]["b2b_cpu_ms_per_passthrough"] = cpu_pad[t] * 1e3 / n
    m["direct"]["b2b_request_bytes"] = float(size)


def hook_cost(template, n: int) -> float:
    """µs per call of the decision code's rewrite() on the benchmark's CreateContainer, in this
    process, built as `serve` builds it: the share of a rewrite no transport can save."""
    from shim.decision import Policy
    from shim.node.facts import load_kubelet_config, node_facts
    from shim.app.service import build_container_qos
    from shim.container.chain import build_request_hooks
    from shim.transport.hooks import RpcCall

    node = node_facts(16 * 1024 * MiB, load_kubelet_config(None), page_size=4096, allocatable=None, factor="auto")
    hooks = build_request_hooks(build_container_qos(node, Policy.HARD, lambda record: None))
    requests = []
    for i in range(n):
        template.config.metadata.attempt = 10_000_000 + i
        requests.append(template.SerializeToString())
    t0 = time.perf_counter()
    for r in requests:
        hooks.rewrite(RpcCall(CREATE_CONTAINER, 0.0, request=r))
    return (time.perf_counter() - t0) / n * 1e6


def derive(m: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    d = m["direct"]
    for name, v in m.items():
        if name == "direct":
            continue
        for k in ("small_p50_us", "small_p99_us", "reply200k_p50_us", "reply16m_p50_ms", "replay_p50_us",
                  "create_p50_us", "passthrough_same_size_p50_us", "b2b_create_p50_us", "b2b_passthrough_p50_us"):
            if k in v and k in d:
                v["added_" + k] = v[k] - d[k]
        if "throughput32_cps" in v:
            v["throughput32_ratio"] = v["throughput32_cps"] / d["throughput32_cps"]
        if "create_p50_us" in v:
            v["hook_rewrite_us"] = d.get("hook_rewrite_us", float("nan"))
            v["rewrite_extra_us"] = v["added_create_p50_us"] - v["added_passthrough_same_size_p50_us"]
        if "b2b_create_p50_us" in v:
            # the create's added latency over the passthrough call's, same run (the target: at
            # most 2); a passthrough added latency below 1 µs counts as 1 µs
            v["b2b_added_ratio"] = v["added_b2b_create_p50_us"] / max(v["added_b2b_passthrough_p50_us"], 1.0)
    return m


def median_runs(runs: list[dict]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name in runs[0]:
        out[name] = {}
        for k in runs[0][name]:
            vals = [r[name][k] for r in runs if k in r.get(name, {})]
            out[name][k] = statistics.median(vals)
    return out
