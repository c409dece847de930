"""/healthz and /readyz beside /metrics on --metrics-address: a real `memqos-shim serve` over a
real HTTP socket, first without its runtime (not ready, and why), then with the fake runtime
started at the upstream path (ready); and the liveness checks' parts on real threads."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from shim.evidence.probes import StuckWatch, dead_threads, unix_socket_problem
from memqos_dev.testing.fake_runtime import FakeRuntimeServer
from shim.worker import Worker
from tests.test_serve import Shim, complete_lines, short_dir


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metrics_address(shim: Shim, deadline: float) -> str:
    while time.monotonic() < deadline:
        for line in complete_lines(shim.audit):
            r = json.loads(line)
            if r.get("event") == "metrics":
                return r["address"]
        time.sleep(0.05)
    raise AssertionError((shim.base / "shim.log").read_text())


def wait_for(url: str, status: int, deadline: float) -> tuple[int, str]:
    got = get(url)
    while got[0] != status and time.monotonic() < deadline:
        time.sleep(0.1)
        got = get(url)
    return got


def test_readyz_says_why_until_the_runtime_answers_then_ready():
    base = short_dir()
    runtime_sock = base / "runtime.sock"
    shim = Shim(base, f"unix://{runtime_sock}", extra=("--metrics-address", "127.0.0.1:0",
                                                       "--resync-interval", "0.5"))
    try:
        deadline = time.monotonic() + 60
        addr = metrics_address(shim, deadline)
        status, body = get(f"http://{addr}/readyz")
        assert status == 503
        assert "the runtime is unreachable" in body and str(runtime_sock) in body
        assert "first rebuild" in body
        assert get(f"http://{addr}/healthz") == (200, "ok\n")
        text = get(f"http://{addr}/metrics")[1]
        assert "memqos_ready 0.0" in text and "memqos_healthy 1.0" in text
        with FakeRuntimeServer(runtime_sock):
            assert wait_for(f"http://{addr}/readyz", 200, deadline) == (200, "ok\n")
            assert "memqos_ready 1.0" in get(f"http://{addr}/metrics")[1]
            assert get(f"http://{addr}/healthz") == (200, "ok\n")
        # the runtime gone again: not ready, the rebuild stays done
        status, body = wait_for(f"http://{addr}/readyz", 503, deadline)
        assert status == 503 and "the runtime is unreachable" in body and "first rebuild" not in body
    finally:
        shim.stop()
    log = (base / "shim.log").read_text()
    assert f"health on http://{addr}/healthz" in log


class Blocking(Worker):
    def __init__(self):
        super().__init__("blocking")
        self.release = threading.Event()

    def put(self, item):
        self._queue.put(item)

    def handle(self, items):
        self.release.wait(30)


class Dying(Worker):
    def __init__(self):
        super().__init__("dying")

    def put(self, item):
        self._queue.put(item)

    def handle(self, items):
        raise SystemExit  # not an Exception: the thread ends


def test_a_worker_stuck_on_an_item_is_reported_once_its_probe_is_old():
    now = [1000.0]
    w = Blocking().start()
    try:
        w.put("item")
        watch = StuckWatch(w, after=60.0, clock=lambda: now[0])
        assert watch.problem() is None  # the first probe is queued
        probe = watch._probe
        now[0] = probe.put_at + 30
        assert watch.problem() is None
        now[0] = probe.put_at + 61
        assert "thread blocking has not reached a mark queued 61 s ago" in watch.problem()
        w.release.set()
        assert probe.wait(10)
        assert watch.problem() is None  # reached: a new probe is queued
    finally:
        w.release.set()
        w.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the dying thread's SystemExit
def test_a_side_thread_that_ended_is_reported_and_a_stopped_one_is_not():
    dying, fine = Dying().start(), Blocking().start()
    try:
        dying.put("item")
        deadline = time.monotonic() + 10
        while dying.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dead_threads([dying, fine, None]) == ["thread dying is not running"]
    finally:
        fine.release.set()
        fine.stop()
    assert dead_threads([fine]) == []


def test_unix_socket_problem_names_the_path(tmp_path):
    assert "No such file" in unix_socket_problem(str(tmp_path / "absent.sock"))


def test_nri_readyz_waits_for_registration_and_the_first_synchronize(tmp_path):
    import asyncio

    from memqos_dev.testing.fake_nri_runtime import FakeNriRuntime
    from tests.test_nri_front import Stack, run

    st = Stack(tmp_path, extra=("--metrics-address", "127.0.0.1:0"))

    async def main():
        loop = asyncio.get_running_loop()
        service = st.service()
        await service.start()
        try:
            host, port = service.metrics.address
            url = f"http://{host}:{port}"
            status, body = await loop.run_in_executor(None, get, f"{url}/readyz")
            assert status == 503 and "not registered with the runtime" in body and st.sock in body
            assert (await loop.run_in_executor(None, get, f"{url}/healthz")) == (200, "ok\n")
            async with FakeNriRuntime(st.sock) as rt:
                await rt.next_plugin()
                got = (0, "")
                for _ in range(200):
                    got = await loop.run_in_executor(None, get, f"{url}/readyz")
                    if got[0] == 200:
                        break
                    await asyncio.sleep(0.05)
                assert got == (200, "ok\n")
                text = (await loop.run_in_executor(None, get, f"{url}/metrics"))[1]
                assert "memqos_nri_registered 1.0" in text and "memqos_nri_registrations_total 1.0" in text
        finally:
            await service.stop()
    run(main())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the reconciler's SystemExit
def test_healthz_fails_when_the_reconciler_thread_ended(tmp_path):
    import asyncio

    from tests.test_nri_front import Stack, run

    st = Stack(tmp_path, extra=("--metrics-address", "127.0.0.1:0"))

    async def main():
        loop = asyncio.get_running_loop()
        service = st.service()
        await service.start()
        try:
            host, port = service.metrics.address
            url = f"http://{host}:{port}/healthz"
            assert (await loop.run_in_executor(None, get, url)) == (200, "ok\n")

            def end(items):
                raise SystemExit  # what no `except Exception` in the thread catches

            service.reconciler.handle = end
            service.reconciler.submit("anything")
            for _ in range(200):
                if not service.reconciler.alive:
                    break
                await asyncio.sleep(0.05)
            status, body = await loop.run_in_executor(None, get, url)
            assert status == 503 and "thread memqos-reconciler is not running" in body
            text = (await loop.run_in_executor(None, get, f"http://{host}:{port}/metrics"))[1]
            assert "memqos_healthy 0.0" in text
        finally:
            await service.stop()
    run(main())
