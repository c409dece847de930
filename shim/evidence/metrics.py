"""Prometheus metrics (--metrics-address HOST:PORT; off by default).

Three feeds, none of which reads a file or blocks on the CRI path:

* the transport: a HookChain observer whose ``finished()`` only bumps a counter and a
  histogram, and ``rewrite_timer``, the HookChain's timers of the rewrite hook;
* the audit stream (``AuditLog.add_listener``, in the audit writer thread): rewrites by QoS
  class and request source, fail-opens, cgroup writes and refusals, guard actions -- the
  metrics count exactly what the audit log says;
* the monitor's last snapshot (shim.guard.monitor: the side thread that reads the cgroup files on an
  interval): per-container memory.current, memory.min/low/high/max in force, memory.events
  counters and memory.pressure; read at scrape time from memory, never from cgroupfs.

Latency: ``memqos_cri_call_duration_seconds`` is the whole call as the shim sees it (request
received -> upstream answered -> answer handed back), i.e. upstream time plus what the shim
adds. The transport does not time the upstream call alone, so the shim's own share is
measured where it does work: ``memqos_cri_rewrite_duration_seconds`` (parse, decide,
serialize on CreateContainer / UpdateContainerResources). The relay itself (one more unix
socket hop each way) is in the total only.
"""
from __future__ import annotations

import logging
import math
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shim.effects.rollout import MODES
from shim.guard.sampling import EVENTS
from shim.transport.hooks import RpcCall
from shim.cri.methods import CRI_METHODS_BY_PATH
from shim.decision.classes import REFUSAL_REASONS

log = logging.getLogger(__name__)

CALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0, 120.0, 300.0)
REWRITE_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                   0.025, 0.1)
CONTAINER_LABELS = ("namespace", "pod", "container", "container_id")
GUARD_EVENTS = ("relax", "restore", "report", "clear", "released", "error")


def method_label(path: str) -> str:
    """'/runtime.v1.RuntimeService/Version' -> 'Version'; anything not in the CRI table -> 'other'
    (bounded label values whatever a client sends)."""
    m = CRI_METHODS_BY_PATH.get(path)
    return m.name if m is not None else "other"


def _inf(v: int | None) -> float:
    return math.inf if v is None else float(v)


class CriObserver:
    """HookChain observer: finished() is two dictionary look-ups and two increments."""

    def __init__(self, metrics: "Metrics"):
        self._calls = metrics.cri_calls
        self._duration = metrics.cri_duration

    def finished(self, call: RpcCall) -> None:
        m = method_label(call.method)
        self._calls.labels(m, call.code).inc()
        self._duration.labels(m).observe(call.duration_ms / 1000.0)


class _LiveCollector:
    """Families computed at scrape time from in-memory state (monitor snapshot, audit, reconciler)."""

    def __init__(self, metrics: "Metrics"):
        self.m = metrics

    @staticmethod
    def _files(audit, recorder):
        """The audit log's and the recorder's files: rotations, reopens (SIGHUP), write errors."""
        writers = [(name, w) for name, w in (("audit", audit), ("record", recorder)) if w is not None]
        if not writers:
            return
        for attr, name, text in (
                ("rotations", "memqos_file_rotations", "size rotations of the shim's own files (FILE -> FILE.1)"),
                ("reopens", "memqos_file_reopens", "reopens of the shim's own files by name (SIGHUP)"),
                ("write_errors", "memqos_file_write_errors", "records that could not be written to the shim's "
                                                             "own files (full disk, a symlink refused)")):
            family = CounterMetricFamily(name, text, labels=("file",))
            for label, w in writers:
                family.add_metric([label], float(getattr(w, attr, 0)))
            yield family
        if recorder is not None:
            dropped = CounterMetricFamily("memqos_recorder_calls_dropped",
                                          "calls the recorder dropped because its writer was behind")
            dropped.add_metric([], float(recorder.dropped))
            yield dropped

    def describe(self):
        return []

    def collect(self):
        m = self.m
        if m.rollout is not None:
            mode = GaugeMetricFamily("memqos_mode", "the shim's mode: 1 for the one it runs in (enforce: it rewrites "
                                     "calls and writes cgroup files; observe: it decides and audits only)",
                                     labels=("mode",))
            for name in MODES:
                mode.add_metric([name], 1.0 if name == m.rollout.mode else 0.0)
            yield mode
        audit = m.audit
        if audit is not None:
            dropped = CounterMetricFamily("memqos_audit_records_dropped",
                                          "audit records dropped because the writer was behind")
            dropped.add_metric([], float(audit.dropped))
            yield dropped
        yield from self._files(audit, m.recorder)
        if m.finisher is not None:
            dropped = CounterMetricFamily("memqos_finish_calls_dropped",
                                          "finished calls whose work after the answer (audit record, recording, "
                                          "reconciler event, CRI metrics) was dropped because more than "
                                          "finish-max-pending were waiting for it")
            dropped.add_metric([], float(m.finisher.dropped))
            yield dropped
        if m.transport is not None:
            yield from self._transport(m.transport)
        relay = m.relay
        if relay is not None:
            hits = CounterMetricFamily("memqos_h2_limit_hits", "times a kubelet connection hit one of the relay's "
                                       "HTTP/2 limits (GOAWAY and closed, or the stream refused), by limit",
                                       labels=("limit",))
            for name, n in list(relay.limit_hits.items()):
                hits.add_metric([name], float(n))
            yield hits
        if m.nri is not None:
            yield from self._nri(m.nri)
        for name, check, doc in (("memqos_healthy", m.health, "1 while /healthz answers 200 (side threads alive, "
                                  "the reconciler and the monitor not stuck)"),
                                 ("memqos_ready", m.ready, "1 while /readyz answers 200 (serve: the runtime's "
                                  "socket accepts and the first rebuild is done; nri: registered and synchronized)")):
            if check is not None:
                g = GaugeMetricFamily(name, doc)
                g.add_metric([], 0.0 if _problems(check) else 1.0)
                yield g
        rec = m.reconciler
        if rec is not None:
            resyncs = CounterMetricFamily("memqos_reconciler_resyncs", "completed reconciler resyncs with the runtime")
            resyncs.add_metric([], float(getattr(rec, "resyncs", 0)))
            yield resyncs
            state = getattr(rec, "state", None)
            if state is not None:
                dropped = CounterMetricFamily(
                    "memqos_reconciler_departures_dropped",
                    "pod departures not kept (too many before a reconciler pass): every pod was then taken as departed")
                dropped.add_metric([], float(getattr(state, "departures_dropped", 0)))
                yield dropped
        mon = m.monitor
        if mon is None:
            return
        snap = mon.snapshot()
        lag = GaugeMetricFamily(
            "memqos_reconciler_lag_seconds",
            "time the reconciler took to work through its queue at the last probe (while a probe is "
            "outstanding: its age so far)")
        if snap.reconciler_lag is not None:
            lag.add_metric([], snap.reconciler_lag)
        yield lag
        g = GaugeMetricFamily("memqos_monitor_containers", "containers the monitor knows of (with or without a cgroup)")
        g.add_metric([], float(snap.containers))
        yield g
        g = GaugeMetricFamily("memqos_monitor_sampled_containers", "containers whose cgroup was read in the last round")
        g.add_metric([], float(len(snap.readings)))
        yield g
        g = GaugeMetricFamily("memqos_monitor_last_sample_timestamp_seconds", "when the last round ended (unix time)")
        if snap.taken_at:
            g.add_metric([], snap.taken_at)
        yield g
        g = GaugeMetricFamily("memqos_monitor_sample_duration_seconds", "how long the last round took")
        g.add_metric([], snap.duration)
        yield g
        c = CounterMetricFamily("memqos_monitor_read_errors", "cgroup reads that failed (other than a vanished cgroup)")
        c.add_metric([], float(snap.read_errors))
        yield c

        def gauge(name, doc):
            return GaugeMetricFamily(name, doc, labels=CONTAINER_LABELS)

        current = gauge("memqos_container_memory_current_bytes", "memory.current")
        mn = gauge("memqos_container_memory_min_bytes", "memory.min in force")
        low = gauge("memqos_container_memory_low_bytes", "memory.low in force")
        high = gauge("memqos_container_memory_high_bytes", "memory.high in force (+Inf: max)")
        mx = gauge("memqos_container_memory_max_bytes", "memory.max in force (+Inf: max)")
        events = CounterMetricFamily("memqos_container_memory_events", "memory.events counters (the kernel's)",
                                     labels=CONTAINER_LABELS + ("event",))
        avg10 = GaugeMetricFamily("memqos_container_memory_pressure_avg10_ratio",
                                  "memory.pressure avg10 (some / full) as a ratio 0..1",
                                  labels=CONTAINER_LABELS + ("kind",))
        stalled = CounterMetricFamily("memqos_container_memory_pressure_stalled_seconds",
                                      "memory.pressure total (some / full) in seconds",
                                      labels=CONTAINER_LABELS + ("kind",))
        relaxed = gauge("memqos_container_guard_relaxed",
                        "1 while the guard has memory.high raised to max for this container")
        n_relaxed = 0
        for r in snap.readings:
            ref = r.ref
            lv = [ref.namespace, ref.pod, ref.container, ref.id]
            if r.current is not None:
                current.add_metric(lv, float(r.current))
            if r.min is not None:
                mn.add_metric(lv, float(r.min))
            if r.low is not None:
                low.add_metric(lv, float(r.low))
            high.add_metric(lv, _inf(r.high))
            mx.add_metric(lv, _inf(r.max))
            for e in EVENTS:
                if e in r.events:
                    events.add_metric(lv + [e], float(r.events[e]))
            for kind in ("some", "full"):
                p = r.pressure.get(kind)
                if not p:
                    continue
                if "avg10" in p:
                    avg10.add_metric(lv + [kind], p["avg10"] / 100.0)
                if "total" in p:
                    stalled.add_metric(lv + [kind], p["total"] / 1e6)
            relaxed.add_metric(lv, 1.0 if r.relaxed else 0.0)
            n_relaxed += r.relaxed
        yield from (current, mn, low, high, mx, events, avg10, stalled, relaxed)
        g = GaugeMetricFamily("memqos_guard_relaxed_containers", "containers whose memory.high the guard holds at max")
        g.add_metric([], float(n_relaxed))
        yield g
        if getattr(mon, "reclaim", None) is not None:
            yield from self._reclaim(mon, snap)

    @staticmethod
    def _nri(plugin):
        """`memqos-shim nri`: the plugin's connections to the runtime and its registration."""
        st = plugin.stats
        g = GaugeMetricFamily("memqos_nri_registered", "1 while the runtime has the plugin registered")
        g.add_metric([], 1.0 if plugin.registered else 0.0)
        yield g
        for name, value, doc in (
                ("memqos_nri_connects", st.connects, "connections the plugin opened to the runtime's NRI socket"),
                ("memqos_nri_registrations", st.registrations, "registrations the runtime accepted (one per "
                 "connection; more than one: the plugin was disconnected and registered again)"),
                ("memqos_nri_failures", st.failures, "connections that failed before or during registration")):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(value))
            yield c
        g = GaugeMetricFamily("memqos_nri_loop_lag_seconds_max", "the longest the plugin's event loop was held "
                              "up (a runtime call's bytes wait unread as long)")
        g.add_metric([], float(st.loop_lag_max))
        yield g
        c = CounterMetricFamily("memqos_nri_loop_stalls", "times the plugin's event loop was held up over 0.1 s")
        c.add_metric([], float(st.loop_stalls))
        yield c
        calls = CounterMetricFamily("memqos_nri_calls", "runtime calls answered, by method", labels=["method"])
        total = CounterMetricFamily("memqos_nri_call_seconds", "time of the runtime's calls by part: handler (from "
                                    "the request read to the answer made), write (to the reply written), after (the "
                                    "hand-over to the side threads once the reply is out)", labels=["method", "part"])
        most = GaugeMetricFamily("memqos_nri_call_seconds_max", "the longest of each part of a runtime call",
                                 labels=["method", "part"])
        for method, t in sorted(st.protocol.times.items()):
            calls.add_metric([method], float(t.count))
            for part in ("handler", "write", "after"):
                total.add_metric([method, part], getattr(t, part))
                most.add_metric([method, part], getattr(t, part + "_max"))
        yield from (calls, total, most)
        confirmer = getattr(plugin.handler, "confirmer", None)
        if confirmer is not None:
            cs = confirmer.stats
            c = CounterMetricFamily("memqos_nri_confirm", "containers' values looked at in their cgroup after an NRI "
                                    "answer, by outcome: confirmed (every value in place), written / reported (one "
                                    "per value that had not landed), gave_up (no cgroup within nri-confirm-window), "
                                    "dropped (nri-confirm-queue full), refused (no valid path)", labels=["outcome"])
            for outcome in ("confirmed", "written", "reported", "gave_up", "dropped", "refused", "errors"):
                c.add_metric([outcome], float(getattr(cs, outcome)))
            yield c

    @staticmethod
    def _transport(t):
        """The relay's limits: the connections it serves and the ones it shed (its public
        counters; absent ones are left out)."""
        connections = getattr(t, "connections", None)
        if connections is not None:
            g = GaugeMetricFamily("memqos_transport_connections", "kubelet connections the relay serves now")
            g.add_metric([], float(len(connections)))
            yield g
            g = GaugeMetricFamily("memqos_transport_max_connections", "the relay's max-connections setting")
            g.add_metric([], float(t.max_connections))
            yield g
            c = CounterMetricFamily(
                "memqos_transport_connections_shed",
                "connections sent GOAWAY and closed: a new one at max-connections with no open one idle "
                "(limit), at its process's max-connections-per-peer likewise (peer_limit), for want of a file "
                "descriptor for the kubelet's side or the runtime's (descriptors); an idle open one for a new "
                "one at max-connections (idle), at its process's max-connections-per-peer (peer_idle)",
                labels=("reason",))
            c.add_metric(["limit"], float(t.shed_limit))
            c.add_metric(["descriptors"], float(t.shed_descriptors))
            for reason in ("peer_limit", "idle", "peer_idle"):
                counted = getattr(t, f"shed_{reason}", None)
                if counted is not None:
                    c.add_metric([reason], float(counted))
            yield c
        if getattr(t, "upstream_failures", None) is not None:
            c = CounterMetricFamily("memqos_transport_upstream_unreachable",
                                    "kubelet connections whose runtime connection could not be made (their calls "
                                    "are answered UNAVAILABLE)")
            c.add_metric([], float(t.upstream_failures))
            yield c

    @staticmethod
    def _reclaim(mon, snap):
        """Proactive reclaim (only with --reclaim true): the monitor's running totals."""
        tot = dict(mon.reclaim_totals)
        c = CounterMetricFamily("memqos_reclaim_writes", "writes to memory.reclaim by outcome (eagain: the kernel "
                                "reclaimed less than asked; error: the write failed)", labels=("result",))
        c.add_metric(["ok"], float(tot["writes"] - tot["eagain"]))
        c.add_metric(["eagain"], float(tot["eagain"]))
        c.add_metric(["error"], float(tot["errors"]))
        yield c
        for name, key, doc in (
                ("memqos_reclaim_asked_bytes", "asked_bytes", "bytes written to memory.reclaim (asked)"),
                ("memqos_reclaim_freed_bytes", "freed_bytes",
                 "bytes reclaimed: memory.current before minus after each write (a lower bound)"),
                ("memqos_reclaim_backoffs", "backoffs", "reclaim back-offs (pressure after reclaim, refaults, "
                 "fruitless EAGAIN)"),
                ("memqos_reclaim_stalls_avoided", "stalls_avoided",
                 "monitor intervals right after a reclaim write in which the container's memory.events high did "
                 "not grow (the kernel did not have to reclaim at memory.high in that interval)"),
                ("memqos_reclaim_high_events_while_active", "high_events_while_active",
                 "memory.events high increments in the interval right after a reclaim write")):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(tot[key]))
            yield c
        per = CounterMetricFamily("memqos_container_reclaimed_bytes", "bytes proactive reclaim freed in this container",
                                  labels=CONTAINER_LABELS)
        for r in snap.readings:
            if r.reclaimed is not None:
                per.add_metric([r.ref.namespace, r.ref.pod, r.ref.container, r.ref.id], float(r.reclaimed))
        yield per


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.cri_calls = Counter("memqos_cri_calls", "CRI calls by method and gRPC status code",
                                 ("method", "code"), registry=r)
        self.cri_duration = Histogram(
            "memqos_cri_call_duration_seconds",
            "whole CRI call as the shim sees it (upstream time plus what the shim adds)",
            ("method",), buckets=CALL_BUCKETS, registry=r)
        self.rewrite_duration = Histogram(
            "memqos_cri_rewrite_duration_seconds",
            "time the shim itself spent rewriting the request (CreateContainer, UpdateContainerResources)",
            ("method",), buckets=REWRITE_BUCKETS, registry=r)
        self.rewrites = Counter("memqos_rewrites", "requests whose unified map the shim changed",
                                ("method", "qos", "request_source"), registry=r)
        self.unchanged = Counter("memqos_unchanged", "decided requests the shim left as they were",
                                 ("method",), registry=r)
        self.fail_opens = Counter("memqos_fail_open", "requests forwarded unchanged because of an error",
                                  ("method",), registry=r)
        self.class_refused = Counter(
            "memqos_class_refused", "class annotations refused (the container got the node's settings), by reason",
            ("reason",), registry=r)
        for reason in REFUSAL_REASONS:
            self.class_refused.labels(reason)
        self.cgroup_writes = Counter("memqos_cgroup_writes", "cgroup files written (audited writes)",
                                     ("level", "file"), registry=r)
        self.cgroup_refusals = Counter("memqos_cgroup_refusals", "cgroup paths refused (outside the tree, symlink, ...)",
                                       ("by",), registry=r)
        self.reconciler_errors = Counter("memqos_reconciler_errors", "reconciler errors (audited)", registry=r)
        self.update_write_errors = Counter(
            "memqos_update_write_errors",
            "updates after which the container's memory.* values could not be written (audit update-write-error)",
            registry=r)
        self.kernel_mismatches = Counter(
            "memqos_kernel_mismatches",
            "containers found holding other memory.* values than decided (audit kernel-mismatch)", registry=r)
        self.systemd_bus_unreachable = Counter(
            "memqos_systemd_bus_unreachable",
            "times the system bus stopped answering the systemd writer (audit systemd-bus state down)", registry=r)
        self.guard_actions = Counter("memqos_guard_actions", "memory.high guard actions",
                                     ("action",), registry=r)
        for a in GUARD_EVENTS:
            self.guard_actions.labels(a)
        self.info = Gauge("memqos_guard_config", "the guard's settings (value 1)",
                          ("action", "threshold_percent", "window_seconds", "cooldown_seconds"), registry=r)
        self.reclaim_info = None  # memqos_reclaim_config, registered only with --reclaim true
        self.audit = None
        self.recorder = None  # shim.evidence.recorder.Recorder (--record): its files' counters
        self.finisher = None  # shim.container.chain.CallFinisher: calls whose work after the answer was dropped
        self.monitor = None
        self.reconciler = None
        self.transport = None  # the CRI transport (the RelayProxy), from Service.start
        self.relay = None  # the relay transport: its limit_hits
        self.rollout = None  # shim.effects.rollout.Rollout: memqos_mode
        self.nri = None  # `memqos-shim nri`: the NRI plugin (its stats and registration)
        self.health = None  # /healthz's check (shim.evidence.probes.Check), from the front end
        self.ready = None  # /readyz's check
        r.register(_LiveCollector(self))
        self.observer = CriObserver(self)
        self._server = None
        self.address: tuple[str, int] | None = None

    # -- wiring
    def attach(self, *, audit=None, monitor=None, reconciler=None, transport=None, relay=None, nri=None,
               health=None, ready=None, recorder=None, rollout=None, finisher=None) -> "Metrics":
        if recorder is not None:
            self.recorder = recorder
        if finisher is not None:
            self.finisher = finisher
        if audit is not None:
            self.audit = audit
            audit.add_listener(self.on_audit)
        if monitor is not None:
            self.monitor = monitor
            g = monitor.guard
            self.info.labels(g.action.value, f"{g.threshold:g}", f"{g.window:g}", f"{g.cooldown:g}").set(1)
            rc = getattr(monitor, "reclaim", None)
            if rc is not None:
                self.reclaim_info = Gauge(
                    "memqos_reclaim_config", "proactive reclaim's settings (value 1)",
                    ("headroom_percent", "headroom_min_bytes", "step_bytes", "rate_bytes", "psi_some_percent",
                     "backoff_seconds"), registry=self.registry)
                self.reclaim_info.labels(f"{rc.headroom_fraction * 100:g}", str(rc.headroom_min_bytes),
                                         str(rc.step_bytes), str(rc.rate_bytes), f"{rc.psi_some_target:g}",
                                         f"{rc.backoff:g}").set(1)
        if reconciler is not None:
            self.reconciler = reconciler
        if transport is not None:
            self.transport = transport
        if relay is not None:
            self.relay = relay
        if rollout is not None:
            self.rollout = rollout
        if nri is not None:
            self.nri = nri
        if health is not None:
            self.health = health
        if ready is not None:
            self.ready = ready
        return self

    def rewrite_timer(self, method: str) -> Callable[[float], None]:
        """What takes the duration of one rewrite of ``method`` (the HookChain's timer)."""
        return self.rewrite_duration.labels(method_label(method)).observe

    # -- the audit stream
    def on_audit(self, record: dict) -> None:
        event = record.get("event")
        refused = record.get("class_refused")
        if refused in REFUSAL_REASONS:  # (a bounded label set)
            self.class_refused.labels(refused).inc()
        if event == "rewrite":
            self.rewrites.labels(str(record.get("method", "")), str(record.get("qos", "")),
                                 str(record.get("request_source", ""))).inc()
        elif event == "unchanged":
            self.unchanged.labels(str(record.get("method", ""))).inc()
        elif event == "fail-open":
            self.fail_opens.labels(str(record.get("method", ""))).inc()
        elif event == "cgroup-write":
            self.cgroup_writes.labels(str(record.get("level", "")), str(record.get("file", ""))).inc()
        elif event == "cgroup-refused":
            self.cgroup_refusals.labels(str(record.get("by", "reconciler"))).inc()
        elif event == "reclaim":
            writes = record.get("writes")
            if isinstance(writes, int) and writes > 0:
                self.cgroup_writes.labels("container", "memory.reclaim").inc(writes)
        elif event == "reconciler-error":
            self.reconciler_errors.inc()
        elif event == "update-write":
            written = record.get("written")
            if isinstance(written, dict) and record.get("rollout") != "observe":
                for file in written:
                    self.cgroup_writes.labels("container", str(file)).inc()
        elif event == "update-write-error":
            self.update_write_errors.inc()
        elif event == "kernel-mismatch":
            self.kernel_mismatches.inc()
        elif event == "systemd-bus" and record.get("state") == "down":
            self.systemd_bus_unreachable.inc()
        elif isinstance(event, str) and event.startswith("guard-"):
            action = event[len("guard-"):]
            if action in GUARD_EVENTS:
                self.guard_actions.labels(action).inc()
                if "new" in record and action in ("relax", "restore"):
                    self.cgroup_writes.labels("container", "memory.high").inc()

    # -- exposition
    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, address: str) -> tuple[str, int]:
        """Start the HTTP server on 'HOST:PORT' (port 0: any free port): /metrics, and /healthz
        and /readyz from the attached checks (shim.evidence.probes). Returns the bound address."""
        from shim.evidence.probes import EndpointServer

        host, port = split_address(address)
        server = EndpointServer(self.registry, health=self.health, ready=self.ready)
        self.address = server.serve(host, port)
        self._server = server
        return self.address

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


def _problems(check) -> list[str]:
    try:
        return list(check())
    except Exception as e:  # noqa: BLE001 - a failing check is a problem, never a failed scrape
        return [f"{e.__class__.__name__}: {e}"]


def split_address(address: str) -> tuple[str, int]:
    """'127.0.0.1:9808' -> ('127.0.0.1', 9808); '[::1]:9808' -> ('::1', 9808)."""
    host, _, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_metrics(cfg, *, audit=None, monitor=None, reconciler=None, recorder=None,
                  rollout=None) -> Metrics | None:
    """The metrics `serve` runs (None without --metrics-address)."""
    if not cfg.metrics_address:
        return None
    return Metrics().attach(audit=audit, monitor=monitor, reconciler=reconciler, recorder=recorder,
                            rollout=rollout)
