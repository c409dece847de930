"""The side threads' base (shim.worker): stop, the sync barrier, throttled errors, the idle
state said once; and the monitor reading the reconciler's published NodeView."""
from __future__ import annotations

import logging
import threading
import time
from shim.app.settings import Config

import pytest

from shim.guard.monitor import build_monitor
from shim.node.facts import KubeletFacts
from shim.node.view import ContainerRef, NodeView
from shim.worker import Probe, ThrottledErrors, Worker
from tests.test_metrics import CID, MI, UID, fake_root, write_cgroup


class Collector(Worker):
    """Handles items slowly, one at a time (or in batches), remembering them."""

    def __init__(self, *, batch: bool = False, delay: float = 0.0, max_pending: int = 0):
        super().__init__("test-worker", max_pending=max_pending)
        self.batch = batch
        self.delay = delay
        self.seen: list = []
        self.batches: list[list] = []
        self.idle_said: list = []
        self.started_in: str | None = None

    def on_start(self) -> None:
        self.started_in = threading.current_thread().name

    def handle(self, items: list) -> None:
        if items:
            self.batches.append(list(items))
        for it in items:
            time.sleep(self.delay)
            self.seen.append(it)

    def on_idle(self, reason: str) -> None:
        self.idle_said.append(reason)

    def on_active(self) -> None:
        self.idle_said.append(None)


def put(w: Worker, item) -> None:
    w._queue.put(item)


def test_start_runs_a_named_thread_and_stop_joins_it_after_what_was_queued():
    w = Collector(delay=0.01).start()
    assert w.running
    for i in range(5):
        put(w, i)
    assert w.stop(timeout=5.0) is True
    assert w.seen == [0, 1, 2, 3, 4] and w.started_in == "test-worker"
    assert not w.running and "test-worker" not in {t.name for t in threading.enumerate()}
    assert w.stop() is False  # not running: nothing to stop


def test_sync_waits_until_everything_queued_before_is_processed():
    w = Collector(delay=0.02).start()
    try:
        for i in range(10):
            put(w, i)
        assert w.sync(timeout=5.0) is True
        assert w.seen == list(range(10))
        p = w.probe()
        assert isinstance(p, Probe) and p.wait(5.0) and p.done_at >= p.put_at
    finally:
        w.stop()


def test_sync_on_a_worker_that_does_not_run_times_out():
    w = Collector()
    assert w.sync(timeout=0.05) is False


def test_batch_worker_takes_everything_queued_at_once():
    w = Collector(batch=True)
    for i in range(4):
        put(w, i)
    w.start()
    try:
        assert w.sync(5.0)
        assert w.batches == [[0, 1, 2, 3]]
    finally:
        w.stop()


def test_a_full_bounded_queue_never_blocks_a_probe():
    w = Collector(max_pending=2)  # not started: nothing drains the queue
    put(w, 1)
    put(w, 2)
    t0 = time.monotonic()
    assert w.probe() is None
    assert w.sync(timeout=0.05) is False
    assert time.monotonic() - t0 < 1.0


def test_a_failing_handle_does_not_stop_the_thread(caplog):
    class Failing(Collector):
        def handle(self, items):
            if items == ["boom"]:
                raise RuntimeError("boom")
            super().handle(items)

    w = Failing().start()
    try:
        with caplog.at_level(logging.ERROR):
            put(w, "boom")
            put(w, "after")
            assert w.sync(5.0)
        assert w.seen == ["after"]
        assert any("test-worker: failed" in r.getMessage() for r in caplog.records)
    finally:
        w.stop()


def test_errors_are_said_once_per_key_and_interval(caplog):
    reported = []
    errors = ThrottledErrors(logging.getLogger("test.worker"), "thing",
                             report=lambda k, m: reported.append((k, m)), every=60.0)
    with caplog.at_level(logging.WARNING, logger="test.worker"):
        assert errors("read/a", "first") is True
        assert errors("read/a", "again") is False  # within the interval: not said
        assert errors("read/b", "other key") is True
        assert errors("read/a", "short interval", every=0.0) is True
    assert reported == [("read/a", "first"), ("read/b", "other key"), ("read/a", "short interval")]
    assert [r.getMessage() for r in caplog.records] == ["thing: first", "thing: other key", "thing: short interval"]


def test_the_idle_state_is_said_once_when_it_changes():
    w = Collector()
    assert w.say_idle("no kubepods yet") is True
    assert w.say_idle("no kubepods yet") is False
    assert w.say_idle(None) is True
    assert w.say_idle(None) is False
    assert w.say_idle("cgroup v1") is True
    assert w.idle_said == ["no kubepods yet", None, "cgroup v1"]


def test_the_first_state_is_always_said():
    w = Collector()
    w.say_idle(None)
    assert w.idle_said == [None]


# -- the monitor reads the reconciler's published view ---------------------------------------
class PublishingReconciler:
    """A reconciler as the monitor may see it: a published view and probe(); its state is off
    limits."""

    def __init__(self, view: NodeView):
        self.view = view
        self.probes: list[Probe] = []

    @property
    def state(self):
        raise AssertionError("the monitor must not touch the reconciler's state")

    def probe(self) -> Probe:
        p = Probe()
        self.probes.append(p)
        return p


def test_the_monitor_samples_the_containers_of_the_published_view(tmp_path):
    root = fake_root(tmp_path)
    write_cgroup(root / "kubepods" / "burstable" / f"pod{UID}" / CID, current=10 * MI)
    ref = ContainerRef(CID, "default", "web-1", "app", UID, f"/kubepods/burstable/pod{UID}", "Burstable")
    rec = PublishingReconciler(NodeView())
    cfg = Config(cgroup_root=str(root), guard_state=None)
    m = build_monitor(cfg, KubeletFacts(source="test", cgroup_driver="cgroupfs"), lambda r: None, reconciler=rec)
    m.tick()
    assert m.snapshot().readings == []  # nothing published yet
    rec.view = NodeView((ref,))  # the reconciler replaces the attribute
    m.tick()
    (reading,) = m.snapshot().readings
    assert reading.ref == ref and reading.current == 10 * MI
    # the lag is measured through the reconciler's probe(), one outstanding at a time
    assert len(rec.probes) == 1
    rec.probes[0].set()
    m.tick()
    assert len(rec.probes) == 2 and m.snapshot().reconciler_lag is not None


def test_a_node_view_is_immutable():
    view = NodeView((ContainerRef(CID, "ns", "p", "c", UID, "/kubepods/podx", "Burstable"),))
    with pytest.raises(AttributeError):
        view.containers = ()  # type: ignore[misc]
    assert isinstance(view.containers, tuple)


def test_the_side_threads_keep_their_names(tmp_path):
    from shim.decision import Policy
    from shim.decision.guard import GuardConfig
    from shim.evidence.audit import AuditLog
    from shim.evidence.recorder import Recorder
    from shim.guard.monitor import Monitor
    from shim.node.reconciler import Reconciler

    workers = [
        AuditLog(None),
        Recorder(str(tmp_path / "trace.jsonl"), {}),
        Reconciler(cgroup_root=str(tmp_path), kubelet=KubeletFacts(), policy=Policy.HARD, capacity=MI,
                   page_size=4096, emit=lambda r: None),
        Monitor(cgroup_root=str(tmp_path), kubelet=KubeletFacts(), guard=GuardConfig(), interval=5.0,
                emit=lambda r: None),
    ]
    for w in workers:
        w.start()
    try:
        names = {t.name for t in threading.enumerate()}
        assert {"audit-writer", "trace-recorder", "memqos-reconciler", "memqos-monitor"} <= names
        assert all(w.sync(5.0) for w in workers)
    finally:
        for w in workers:
            getattr(w, "close", w.stop)()
    assert not {"audit-writer", "trace-recorder", "memqos-reconciler", "memqos-monitor"} & {
        t.name for t in threading.enumerate()}
