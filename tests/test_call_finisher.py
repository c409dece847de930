"""The hooks' work after each answer, off the transport's thread: ``CallFinisher`` batches it,
``HookChain`` defers to it (serve's wiring), nothing is lost or reordered, stop flushes, and the
bound drops and counts."""
from __future__ import annotations

import threading

import grpc

from shim.container.chain import CallFinisher, build_request_hooks
from shim.container.rewriter import ContainerMemoryQoS
from shim.cri import pb
from shim.cri.methods import CREATE_CONTAINER, RUN_POD_SANDBOX, UPDATE_CONTAINER_RESOURCES, VERSION
from shim.decision import NodeFacts, Policy
from shim.transport.hooks import RpcCall
from tests.kubelet_requests import MI, create_container, sandbox_config, update_resources

NODE = NodeFacts(capacity=2060419072, allocatable=1850703872, page_size=4096, factor=0.9)
HOUR = 3600.0  # a batch delay no test waits out: only sync and stop run the batch


def test_calls_wait_for_the_batch_and_run_in_order_on_the_finisher_thread():
    done = []
    f = CallFinisher(lambda c: done.append((c, threading.current_thread().name)), delay=HOUR).start()
    try:
        for i in range(20):
            f.submit(i)
        assert done == [] and f.pending == 20  # the first call woke the thread, which waits for the others
        assert f.sync(10)
        assert done == [(i, "call-finisher") for i in range(20)]
        assert (f.done, f.batches, f.largest_batch, f.dropped) == (20, 1, 20, 0)
    finally:
        f.stop()


def test_stop_runs_what_was_submitted_before_it():
    done = []
    f = CallFinisher(done.append, delay=HOUR).start()
    for i in range(5):
        f.submit(i)
    f.stop()
    assert done == [0, 1, 2, 3, 4] and not f.alive


def test_a_failing_call_does_not_stop_the_others():
    done = []

    def work(c):
        if c == 1:
            raise RuntimeError("boom")
        done.append(c)

    f = CallFinisher(work, delay=HOUR).start()
    try:
        for i in range(3):
            f.submit(i)
        assert f.sync(10)
        assert done == [0, 2] and f.alive
    finally:
        f.stop()


def test_beyond_max_pending_a_calls_work_is_dropped_and_counted_in_the_metrics():
    from shim.evidence.metrics import Metrics
    from tests.test_metrics import value

    done = []
    f = CallFinisher(done.append, max_pending=3, delay=HOUR)  # not started: nothing is taken
    for i in range(5):
        f.submit(i)
    assert f.dropped == 2 and f.pending == 3
    metrics = Metrics().attach(finisher=f)
    assert value(metrics.render().decode(), "memqos_finish_calls_dropped_total") == 2
    f.start()
    assert f.sync(10)
    f.stop()
    assert done == [0, 1, 2]


def test_the_setting_bounds_serves_finisher():
    from shim.cli.main import build_parser
    from shim.app.config import resolve

    cfg = resolve(build_parser().parse_args(["serve"]))
    assert cfg.finish_max_pending == 10000


def _create(cid_sandbox: str, name: str) -> bytes:
    sb = sandbox_config("p" + cid_sandbox, "0a1b" + cid_sandbox, "burstable")
    return create_container(cid_sandbox, sb, name, "burstable", request=32 * MI, limit=128 * MI).SerializeToString()


def test_a_deferring_chain_remembers_the_container_at_once_and_audits_later_in_order():
    """serve's wiring: finished() on the transport's thread remembers the created container (an
    UpdateContainerResources right after the answer finds it), while the audit records and the
    observers run on the finisher's thread, in the order the calls ended, fail-open records
    included."""
    records = []
    seen = []

    class Observer:
        def finished(self, call):
            seen.append((call.method, threading.current_thread().name))

    qos = ContainerMemoryQoS(NODE, Policy.HARD, records.append)
    chain = build_request_hooks(qos, [Observer()])
    f = CallFinisher(chain.after, delay=HOUR).start()
    chain.defer_to(f)
    try:
        call = RpcCall(CREATE_CONTAINER, 100.0, request=_create("s1", "main"))
        out = chain.rewrite(call)
        chain.finished(call.complete(2.0, out, [pb.CreateContainerResponse(container_id="c1").SerializeToString()],
                                     "OK", ""))
        assert "c1" in qos.containers and records == [] and seen == []
        chain.not_rewritten(CREATE_CONTAINER, "transport: too large")
        upd = RpcCall(UPDATE_CONTAINER_RESOURCES, 101.0,
                      request=update_resources("c1", limit=256 * MI, oom_score_adj=984).SerializeToString())
        out = chain.rewrite(upd)
        chain.finished(upd.complete(1.0, out, [b""], "OK", ""))
        chain.finished(RpcCall(VERSION, 102.0, responses=[b""]))
        assert records == []
        assert f.sync(10)
    finally:
        f.stop()
    assert [r["event"] for r in records] == ["rewrite", "fail-open", "rewrite"]
    assert records[0]["container_id"] == "c1" and records[0]["time"] == 100.002
    assert records[2]["request_remembered"] is True and records[2]["container"] == "main"
    assert seen == [(CREATE_CONTAINER, "call-finisher"), (UPDATE_CONTAINER_RESOURCES, "call-finisher"),
                    (VERSION, "call-finisher")]


def test_without_a_finisher_the_chain_does_everything_in_finished():
    records = []
    qos = ContainerMemoryQoS(NODE, Policy.HARD, records.append)
    chain = build_request_hooks(qos)
    call = RpcCall(CREATE_CONTAINER, 0.0, request=_create("s1", "main"))
    out = chain.rewrite(call)
    chain.finished(call.complete(1.0, out, [pb.CreateContainerResponse(container_id="c1").SerializeToString()],
                                 "OK", ""))
    assert [r["container_id"] for r in records] == ["c1"]


def test_serve_stop_writes_the_records_of_calls_still_in_the_batch(tmp_path):
    """The records of calls answered just before serve stops are in the audit file: stop runs the
    finisher's batch before the audit log closes (the batch's delay set to an hour here)."""
    import json

    from memqos_dev.testing.fake_runtime import FakeRuntimeServer
    from tests.reconciler_support import ServiceThread

    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "cgroup.controllers").write_text("memory\n")
    (tmp_path / "meminfo").write_text("MemTotal: 16777216 kB\n")
    audit = tmp_path / "audit.jsonl"
    listen = tmp_path / "shim.sock"
    with FakeRuntimeServer(str(tmp_path / "rt.sock")) as rt:
        svc = ServiceThread(["--listen", f"unix://{listen}", "--upstream", f"unix://{rt.path}",
                             "--kubelet-config", "none", "--cgroup-root", str(tmp_path / "cg"),
                             "--meminfo", str(tmp_path / "meminfo"), "--page-size", "4096",
                             "--audit-log", str(audit), "--reconcile", "false", "--monitor-interval", "0",
                             "--kubelet-version", "1.30"]).start()
        try:
            svc.service.finisher.delay = HOUR
            with grpc.insecure_channel(f"unix://{listen}") as ch:
                sb = sandbox_config("web", "0a1b", "burstable")
                sid = pb.RunPodSandboxResponse.FromString(ch.unary_unary(RUN_POD_SANDBOX)(
                    pb.RunPodSandboxRequest(config=sb).SerializeToString(), timeout=10)).pod_sandbox_id
                create = ch.unary_unary(CREATE_CONTAINER)
                for i in range(3):
                    create(create_container(sid, sb, f"c{i}", "burstable", request=32 * MI,
                                            limit=128 * MI).SerializeToString(), timeout=10)
            assert svc.service.finisher.pending == 3  # the creates, waiting (no one wants RunPodSandbox here)
        finally:
            svc.stop()
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    created = [r for r in records if r.get("method") == "CreateContainer"]
    assert [r["container"] for r in created] == ["c0", "c1", "c2"]
    assert all(r["code"] == "OK" and r["container_id"] for r in created)


def test_only_the_calls_someone_wants_are_handed_to_the_finisher():
    """Without an observer that wants every call, a call nobody has work for (a poll) does not
    wake the finisher: the rewriter wants what it rewrote, the reconciler's observer its methods,
    an UNAVAILABLE and the first call that succeeds after one."""
    import queue

    from shim.cri.methods import CONTAINER_STATUS

    LIST_CONTAINERS = "/runtime.v1.RuntimeService/ListContainers"
    from shim.node.reconciler import ReconcilerObserver

    qos = ContainerMemoryQoS(NODE, Policy.HARD, lambda r: None)
    qos.forget_from_calls = False
    observer = ReconcilerObserver(queue.SimpleQueue())
    chain = build_request_hooks(qos, [observer])
    f = CallFinisher(chain.after, delay=HOUR)  # not started: what is handed over stays there
    chain.defer_to(f)
    chain.finished(RpcCall(LIST_CONTAINERS, 0.0, responses=[b""]))
    chain.finished(RpcCall(VERSION, 0.0, responses=[b""]))
    assert f.pending == 0
    call = RpcCall(CREATE_CONTAINER, 0.0, request=_create("s1", "main"))
    chain.finished(call.complete(1.0, chain.rewrite(call), [b""], "OK", ""))
    chain.finished(RpcCall(CONTAINER_STATUS, 0.0, responses=[b""]))
    chain.finished(RpcCall(VERSION, 0.0, code="UNAVAILABLE"))
    assert f.pending == 3
    # the first call that succeeds after an UNAVAILABLE is wanted (it asks for the resync), the next one not
    chain.finished(RpcCall(VERSION, 0.0, responses=[b""]))
    chain.finished(RpcCall(VERSION, 0.0, responses=[b""]))
    assert f.pending == 4
    f.handle([])

    chain.observers.append(object())  # a part without wants() wants every call
    chain.defer_to(f)
    chain.finished(RpcCall(LIST_CONTAINERS, 0.0, responses=[b""]))
    assert f.pending == 1


def test_a_failed_create_while_the_runtime_is_down_still_tells_the_reconcilers_observer():
    """Every part is asked: the rewriter wants a failed create, and the reconciler's observer
    still sees that the runtime was down, so the first call that succeeds afterwards is handed
    over and asks for the resync."""
    import queue

    from shim.node.reconciler import ReconcilerObserver

    q = queue.SimpleQueue()
    qos = ContainerMemoryQoS(NODE, Policy.HARD, lambda r: None)
    chain = build_request_hooks(qos, [ReconcilerObserver(q)])
    f = CallFinisher(chain.after, delay=HOUR)
    chain.defer_to(f)
    call = RpcCall(CREATE_CONTAINER, 0.0, request=_create("s1", "main"))
    chain.finished(call.complete(1.0, chain.rewrite(call), [], "UNAVAILABLE", "down"))
    chain.finished(RpcCall(VERSION, 0.0, responses=[b""]))
    assert f.pending == 2
    f.handle([])
    assert type(q.get_nowait()).__name__ == "_Resync"
