"""The benchmark's client side: latencies with calls alternating between the targets (sync
grpcio), and concurrent load, slow calls and trace replay (grpc.aio)."""
from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from typing import Any, Callable

from shim.cri.methods import PULL_IMAGE, VERSION
from memqos_dev.tools.bench.workload import CLIENT_MAX, Sizes


class Client:
    def __init__(self, targets: dict[str, str]) -> None:
        import grpc

        self.grpc = grpc
        self.targets = targets
        opts = [("grpc.max_receive_message_length", CLIENT_MAX), ("grpc.max_send_message_length", CLIENT_MAX)]
        self.opts = opts
        self.channels = {n: grpc.insecure_channel(t, options=opts) for n, t in targets.items()}
        self._mc: dict[tuple[str, str], Callable] = {}

    def unary(self, name: str, method: str) -> Callable:
        key = (name, method)
        mc = self._mc.get(key)
        if mc is None:
            mc = self._mc[key] = self.channels[name].unary_unary(method)
        return mc

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()

    def alternate(self, method: str, requests: Callable[[int, str], bytes], n: int,
                  timeout: float = 30.0) -> dict[str, list[float]]:
        """n calls per target, the target order cycling through every permutation (so each
        target follows each other one equally often: what the previous call leaves running,
        e.g. a shim's finished() after a CreateContainer, hits them alike); latencies in
        seconds."""
        names = list(self.targets)
        out: dict[str, list[float]] = {x: [] for x in names}
        calls = {x: self.unary(x, method) for x in names}
        clock = time.perf_counter
        orders = list(itertools.permutations(names))
        for i in range(n):
            for name in orders[i % len(orders)]:
                req = requests(i, name)
                t0 = clock()
                calls[name](req, timeout=timeout)
                out[name].append(clock() - t0)
        return out

    def back_to_back(self, kinds: dict[str, tuple[str, Callable[[int, str], bytes]]], n: int, block: int,
                     cpu_s: dict[str, Callable[[], float]], settle: float = 0.1, timeout: float = 30.0,
                     ) -> tuple[dict[str, dict[str, list[float]]], dict[str, dict[str, float]]]:
        """For each kind of call (name -> (method, requests)), n calls per target in blocks of
        ``block`` calls sent back to back (each one as soon as the answer to the one before is
        in). A round is one block of each kind against each target, the targets' order and the
        kinds' order rotating from round to round, so that drift on the machine hits every kind
        and target alike. Returns latencies in seconds per kind and target, and per kind the CPU
        seconds (``cpu_s[target]()``, for the targets with a process of their own) each target's
        process spent from the start of its blocks to ``settle`` seconds after their last
        answer (so what a process does after an answer counts with the call, wherever it
        runs)."""
        names = list(self.targets)
        kind_names = list(kinds)
        out = {k: {x: [] for x in names} for k in kind_names}
        cpu = {k: {x: 0.0 for x in names if x in cpu_s} for k in kind_names}
        calls = {k: {x: self.unary(x, kinds[k][0]) for x in names} for k in kind_names}
        clock = time.perf_counter
        i = 0
        for b in range((n + block - 1) // block):
            count = min(block, n - b * block)
            t = b % len(names)
            for name in names[t:] + names[:t]:
                k0 = b % len(kind_names)
                for kind in kind_names[k0:] + kind_names[:k0]:
                    call, lat = calls[kind][name], out[kind][name]
                    reqs = [kinds[kind][1](i + j, name) for j in range(count)]
                    measured = name in cpu[kind]
                    if measured:
                        time.sleep(settle)  # what making the requests cost the target is not counted
                    c0 = cpu_s[name]() if measured else 0.0
                    for req in reqs:
                        t0 = clock()
                        call(req, timeout=timeout)
                        lat.append(clock() - t0)
                    time.sleep(settle)
                    if measured:
                        cpu[kind][name] += cpu_s[name]() - c0
            i += count
        return out, cpu

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for name in self.targets:
            while True:
                try:
                    self.unary(name, VERSION)(b"", timeout=2)
                    break
                except self.grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)


async def aio_closed_loop(target: str, opts, seconds: float | None, total: int | None, callers: int,
                           method: str = VERSION, request: bytes = b"") -> tuple[int, float]:
    import grpc

    async with grpc.aio.insecure_channel(target, options=opts) as ch:
        mc = ch.unary_unary(method)
        await mc(request, timeout=10)
        done = 0
        t_end = None if seconds is None else time.perf_counter() + seconds
        remaining = [total or 0]

        async def caller():
            nonlocal done
            while True:
                if t_end is not None:
                    if time.perf_counter() >= t_end:
                        return
                else:
                    if remaining[0] <= 0:
                        return
                    remaining[0] -= 1
                await mc(request, timeout=30)
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(callers)))
        return done, time.perf_counter() - t0


def throughput(client: Client, sizes: Sizes) -> dict[str, float]:
    names = list(client.targets)
    per: dict[str, list[float]] = {x: [] for x in names}
    for b in range(sizes.throughput_blocks):
        k = b % len(names)
        for name in names[k:] + names[:k]:
            n, dt = asyncio.run(aio_closed_loop(client.targets[name], client.opts, sizes.throughput_seconds,
                                                 None, 32))
            per[name].append(n / dt)
    return {x: statistics.median(v) for x, v in per.items()}


def load_calls(target: str, opts, n: int) -> None:
    asyncio.run(aio_closed_loop(target, opts, None, n, 32))


async def quick_under_slow(target: str, opts, quick: int) -> list[float]:
    import grpc

    from shim.cri import pb

    async with grpc.aio.insecure_channel(target, options=opts) as ch:
        pull = ch.unary_unary(PULL_IMAGE)
        version = ch.unary_unary(VERSION)
        await version(b"", timeout=10)
        slow = [asyncio.ensure_future(pull(pb.PullImageRequest(image=pb.ImageSpec(image=f"localhost/slow:{i}"))
                                           .SerializeToString(), timeout=60)) for i in range(100)]
        await asyncio.sleep(0.5)  # all 100 reach the runtime, which holds them SLOW_DELAY s
        lat = []
        for _ in range(quick):
            t0 = time.perf_counter()
            await version(b"", timeout=30)
            lat.append(time.perf_counter() - t0)
            await asyncio.sleep(0.02)
        assert not all(f.done() for f in slow), "the slow calls ended before the quick ones"
        await asyncio.gather(*slow)
        return lat


async def replay_calls(target: str, opts, schedule: list[tuple[float, str, bytes]]) -> list[float]:
    import grpc

    async with grpc.aio.insecure_channel(target, options=opts) as ch:
        mcs: dict[str, Any] = {}
        lat: list[float] = []
        errors = 0

        async def one(method: str, req: bytes) -> None:
            nonlocal errors
            mc = mcs.get(method) or mcs.setdefault(method, ch.unary_unary(method))
            t0 = time.perf_counter()
            try:
                await mc(req, timeout=10)
            except grpc.aio.AioRpcError:
                errors += 1
            lat.append(time.perf_counter() - t0)

        await ch.unary_unary(VERSION)(b"", timeout=10)
        t0 = time.perf_counter()
        tasks = []
        for offset, method, req in schedule:
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(method, req)))
        await asyncio.gather(*tasks)
        if errors:
            raise RuntimeError(f"{errors} replayed calls failed on {target}")
        return lat
