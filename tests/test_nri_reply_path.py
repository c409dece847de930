"""NRI mode's reply path: nothing that wakes a side thread (audit record, node event,
confirmation) is handed over before the reply to the runtime is written; each call's times
(read, decided, written) are kept per method; the heartbeat file is written off the loop."""
from __future__ import annotations

import asyncio
import json

from shim.container.nri_handler import NriMemoryQoS
from shim.decision import Policy
from shim.evidence.health import Heartbeat
from shim.nri import api_pb2 as pb
from shim.nri.plugin import PLUGIN_CONN, PLUGIN_SERVICE, RUNTIME_CONN, NriProtocol
from shim.tools.kubelet_requests import MI
from shim.transport.ttrpc_mux import TtrpcMux
from shim.transport.wire import mux, ttrpc
from tests.test_nri_front import NODE, UB, nri_container, nri_pod

REQ = json.dumps({"app": "256Mi"})


class Confirmer:
    def __init__(self):
        self.submitted = []

    def submit(self, expected):
        self.submitted.append(expected)
        return True

    def kernel_values(self, *a):
        return None


def create_request() -> ttrpc.Request:
    pod = nri_pod("b", UB, "burstable", {"memqos.io/requests": REQ})
    c = nri_container("cb", pod, "app", "burstable", request=256 * MI, limit=1024 * MI)
    return ttrpc.Request(PLUGIN_SERVICE, "CreateContainer",
                         pb.CreateContainerRequest(pod=pod, container=c).SerializeToString(), 2_000_000_000)


def test_side_threads_get_nothing_until_the_reply_is_written():
    records, events, confirmer = [], [], Confirmer()
    handler = NriMemoryQoS(NODE, Policy.HARD, records.append, enqueue=events.append, confirmer=confirmer)
    proto = NriProtocol(handler)
    req = create_request()
    reply = proto.serve(req)
    adjust = pb.CreateContainerResponse.FromString(reply.payload).adjust
    assert adjust.linux.resources.unified["memory.min"] == str(256 * MI)
    assert (records, events, confirmer.submitted) == ([], [], [])  # the runtime is still waiting
    proto.replied(req, 1.0, 1.25, 1.5)
    assert [r["event"] for r in records] == ["rewrite"] and len(events) == 1
    [e] = confirmer.submitted
    assert e.container_id == "cb" and e.values["memory.min"] == str(256 * MI) and e.method == "CreateContainer"
    times = proto.stats.times["CreateContainer"]
    assert times.count == 1 and times.handler == times.handler_max == 0.25 and times.write == 0.25


class Writer:
    """A StreamWriter stand-in that keeps what is written."""

    def __init__(self):
        self.data = bytearray()

    def write(self, data):
        self.data += data

    def close(self):
        pass


def test_the_mux_reports_a_reply_after_writing_it_with_its_times():
    seen = []
    writer = Writer()

    def replied(request, received, decided, written):
        seen.append((request.method, bytes(writer.data), received <= decided <= written))

    m = TtrpcMux(None, writer, serve_conn=PLUGIN_CONN, client_conn=RUNTIME_CONN,
                 handler=lambda r: ttrpc.Response(b"ok"), replied=replied)
    client = ttrpc.Connection(client=True)
    client.send_request(ttrpc.Request(PLUGIN_SERVICE, "StateChange", b""))
    client.send_request(ttrpc.Request(PLUGIN_SERVICE, "Shutdown", b""))
    wire = mux.encode(PLUGIN_CONN, client.data_to_send(), mux.SEND_FRAME)
    for conn_id, payload in mux.MuxDecoder({PLUGIN_CONN}, mux.MAX_FRAME).receive_data(wire):
        m._served(m._server.receive_data(payload), 1.0)
    [(first, written_first, ordered1), (second, written_second, ordered2)] = seen
    assert (first, second) == ("StateChange", "Shutdown") and ordered1 and ordered2
    # each reply is on the socket when it is reported, the first before the second is answered
    assert written_first and len(written_second) > len(written_first)


def test_the_heartbeat_file_is_written_off_the_event_loop(tmp_path):
    import threading

    where = []
    hb = Heartbeat(str(tmp_path / "health"), interval=0.01)
    beat = hb.beat
    hb.beat = lambda state: where.append(threading.current_thread() is threading.main_thread()) or beat(state)

    async def main():
        task = asyncio.ensure_future(hb.run(lambda: "registered"))
        while not where:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    asyncio.run(main())
    assert where and not any(where)


def test_what_registration_does_not_need_is_imported_after_the_plugin_starts(tmp_path):
    """NriService.from_config (everything before the plugin connects) leaves the metrics, the
    HTTP server and the guard unimported; start() builds them in a thread while the plugin
    registers."""
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "meminfo").write_text("MemTotal: 8000000 kB\n")
    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "cgroup.controllers").write_text("memory\n")
    code = f"""
import sys
from shim.cli.main import build_parser
from shim.app.config import resolve
from shim.app.nri_front import NriService
d = {str(tmp_path)!r}
cfg = resolve(build_parser().parse_args(["nri", "--nri-socket", d + "/nri.sock", "--kubelet-config", "none",
    "--cgroup-root", d + "/cg", "--meminfo", d + "/meminfo", "--audit-log", "none", "--kubelet-version", "1.33",
    "--metrics-address", "127.0.0.1:0"]))
s = NriService.from_config(cfg)
print(sorted(m for m in ("prometheus_client", "http.server", "shim.guard.monitor", "shim.evidence.metrics")
             if m in sys.modules))
s.build_side()
print(s.monitor is not None, s.metrics is not None, "prometheus_client" in sys.modules)
"""
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[]", "True True True"]


def test_records_before_the_metrics_are_built_are_counted_once(tmp_path):
    from prometheus_client import generate_latest

    from tests.test_nri_front import Stack

    st = Stack(tmp_path, extra=("--metrics-address", "127.0.0.1:0"))
    service = st.service()
    try:
        pod = nri_pod("b", UB, "burstable", {"memqos.io/requests": REQ})
        service.handler.create_container(pod, nri_container("c1", pod, "app", "burstable", request=256 * MI,
                                                            limit=1024 * MI))
        assert service.audit.sync(10)
        assert service.metrics is None
        service.build_side()  # (start() runs it while the plugin registers)
        service.handler.create_container(pod, nri_container("c2", pod, "app", "burstable", request=256 * MI,
                                                            limit=1024 * MI))
        assert service.audit.sync(10)
        text = generate_latest(service.metrics.registry).decode()
        [line] = [x for x in text.splitlines() if x.startswith('memqos_rewrites_total{method="CreateContainer"')]
        assert line.endswith(" 2.0")
    finally:
        service.audit.close()
        service.reconciler.stop()


def test_a_held_up_event_loop_is_counted_and_said_at_debug(caplog):
    """watch_loop: a callback that holds the loop (a blocking sleep far above STALL) is one
    stall in the stats, the longest hold-up kept, and at debug level a line per hold-up naming
    where the other threads are."""
    import logging
    import threading
    import time

    from shim.nri.plugin import STALL, PluginStats, watch_loop

    stats = PluginStats()
    done = threading.Event()
    side = threading.Thread(target=done.wait, name="side-thread", daemon=True)
    side.start()

    async def main():
        task = asyncio.ensure_future(watch_loop(stats, interval=0.01))
        await asyncio.sleep(0.05)  # the watcher is sleeping
        time.sleep(STALL * 4)  # the loop is held
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    try:
        with caplog.at_level(logging.DEBUG, logger="shim.nri"):
            asyncio.run(main())
    finally:
        done.set()
    assert stats.loop_stalls >= 1 and stats.loop_lag_max > STALL
    [line] = [r.getMessage() for r in caplog.records if "event loop was held up" in r.getMessage()
              and r.levelno == logging.DEBUG][:1]
    assert "side-thread: wait threading.py" in line


def test_the_nri_reconciler_does_not_import_the_runtime_client(tmp_path):
    """NRI mode's reconciler has no runtime client: its start-up and its resyncs after a
    Synchronize leave the CRI client's modules unimported (their imports held the interpreter
    for seconds on a slow node, while the runtime's first calls waited)."""
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "meminfo").write_text("MemTotal: 8000000 kB\n")
    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "cgroup.controllers").write_text("memory\n")
    code = f"""
import sys
from shim.cli.main import build_parser
from shim.app.config import resolve
from shim.app.nri_front import NriService
d = {str(tmp_path)!r}
cfg = resolve(build_parser().parse_args(["nri", "--nri-socket", d + "/nri.sock", "--kubelet-config", "none",
    "--cgroup-root", d + "/cg", "--meminfo", d + "/meminfo", "--audit-log", "none", "--kubelet-version", "1.33"]))
s = NriService.from_config(cfg)
s.reconciler.start()
assert s.reconciler.sync(30)
s.handler.synchronize([], [])
s.handler.replied()
assert s.reconciler.sync(30)
print(s.reconciler.listings, "shim.node.runtime_client" in sys.modules)
s.reconciler.stop()
"""
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["1 False"]
