"""The running shim: node facts, audit log, container memory QoS and the proxy, wired
together from a Config. Everything here happens once at start, in this order: the node facts
and the KubeletConfiguration (small files), the audit log, the rewriter, the recorder, the side
threads' objects (wired into the hooks, so they see every call); then the socket is bound and
forwards calls; only then do the slow parts begin: the kubelet's version searched for in the
background (``--kubelet-version auto``: until it is found, ownership is decided without it and
revisited once it is known), the reconciler's rebuild from the runtime, the monitor, the
metrics server."""
from __future__ import annotations

import logging

from shim.app.config import Config
from shim.app.config_classes import class_options, unprotected_classes
from shim.container.chain import CallFinisher, build_request_hooks
from shim.container.rewriter import ContainerMemoryQoS
from shim.cri.methods import CRI_METHODS
from shim.effects.rollout import OBSERVE, Rollout
from shim.evidence.audit import AuditLog
from shim.node.facts import is_cgroup_v2, load_kubelet_config, node_facts, read_mem_total, system_page_size

log = logging.getLogger(__name__)


def build_container_qos(node, policy, emit, *, cgroup_v2: bool = True, cgroup_root: str = "",
                        ownership=None, rollout: Rollout | None = None, **classes) -> ContainerMemoryQoS:
    """The CreateContainer / UpdateContainerResources rewriter exactly as `serve` builds it
    (`memqos-shim replay` builds its request path with this too). ``ownership``
    (shim.node.kubelet.Ownership): the unified keys the kubelet owns are forwarded unchanged.
    ``rollout``: enforce or observe (shim.effects.rollout), shared with the cgroup writers.
    ``classes``: ``classes`` (a ClassTable), ``guard_action`` and ``reclaim``, as
    ``class_options(cfg)`` makes them (none: the node's settings for every container)."""
    reason = "" if cgroup_v2 else f"{cgroup_root}/cgroup.controllers not found (not cgroup v2; runc would reject unified)"
    return ContainerMemoryQoS(node, policy, emit, enabled=cgroup_v2, disabled_reason=reason, ownership=ownership,
                              rollout=rollout, **classes)


VERSION_PENDING = "auto: not known yet, `kubelet --version` runs in the background"


def kubelet_ownership(cfg: Config, kubelet, version=None, *, nri: bool = False):
    """(KubeletWrites, Ownership, how the version was found, whether it is still to be found)
    for this node: the kubelet's version (--kubelet-version, or ``version`` when given), what it
    writes itself, and who owns each value. With 'auto' nothing is run here: until the
    background search (shim.node.kubelet_version) finds the version, the ownership is the
    conservative one of an unknown version. ``nri``: NRI mode's ownership (container keys the
    kubelet writes stay the kubelet's, shim.node.kubelet.ownership)."""
    from shim.node.kubelet import detect_kubelet_version, kubelet_writes, ownership

    pending = False
    if version is not None:
        how = ""
    elif str(cfg.kubelet_version or "auto").strip().lower() == "auto":
        how, pending = VERSION_PENDING, True
    else:
        version, how = detect_kubelet_version(cfg.kubelet_version)
    writes = kubelet_writes(kubelet, version)
    return writes, ownership(writes, cfg.policy, nri=nri), how, pending


def read_node(cfg: Config):
    """What both front ends read of the node at start: (the KubeletConfiguration, MemTotal, the
    page size, the node's facts, whether the cgroup root is cgroup v2)."""
    kubelet = load_kubelet_config(cfg.kubelet_config)
    for problem in kubelet.problems:
        log.warning("kubelet config: %s", problem)
    capacity = read_mem_total(cfg.meminfo)
    page = cfg.page_size or system_page_size()
    return kubelet, capacity, page, decided_node(cfg, kubelet, capacity, page), is_cgroup_v2(cfg.cgroup_root)


def decided_node(cfg: Config, kubelet, capacity: int, page: int):
    """The node's facts as the decision takes them from the settings: both front ends, and
    `replay` from the recording's settings (shim.app.decides)."""
    return node_facts(capacity, kubelet, page_size=page, allocatable=cfg.node_allocatable, factor=cfg.factor,
                      headroom_ratio=cfg.protection_headroom_ratio, headroom_min=cfg.protection_headroom_min,
                      correct_kubelet_min=cfg.correct_kubelet_min)


def start_audit(cfg: Config) -> AuditLog:
    """The audit log both front ends write (UnsafeFile / OSError when its file cannot be opened)."""
    return AuditLog(cfg.audit_log, max_bytes=cfg.audit_max_bytes, keep=cfg.audit_keep).start()


def log_ownership(owners, cgroup_v2: bool, cgroup_root: str) -> None:
    """Who writes which value, one line per owner and reason; on cgroup v1 (where nothing is
    written) one warning instead."""
    if not cgroup_v2:
        log.warning("%s is not a cgroup v2 hierarchy: containers are created without memory QoS (runc rejects "
                    "`unified` on cgroup v1), every request is forwarded unchanged", cgroup_root)
        return
    for line in owners.summary_lines():
        log.info("owner %s", line)


def warn_missing_upstream(endpoint: str) -> bool:
    """Say when the runtime's socket is not there (yet): the kubelet's calls are answered
    UNAVAILABLE until it is. True when a warning was logged."""
    import os
    import stat

    from shim.transport.endpoints import socket_path

    try:
        path = socket_path(endpoint)
        mode = os.stat(path).st_mode
    except ValueError:
        return False  # the transport says why
    except FileNotFoundError:
        log.warning("the runtime's socket %s does not exist (upstream: %s, the --upstream flag or `upstream:` in "
                    "the config file): calls are answered UNAVAILABLE until the runtime listens there", path, endpoint)
        return True
    except OSError as e:
        log.warning("cannot look at the runtime's socket %s (upstream: %s): %s", path, endpoint, e.strerror)
        return True
    if not stat.S_ISSOCK(mode):
        log.warning("%s is not a socket (upstream: %s, the --upstream flag or `upstream:` in the config file): "
                    "calls are answered UNAVAILABLE", path, endpoint)
        return True
    return False


def protobuf_backend() -> str:
    from google.protobuf.internal import api_implementation

    return api_implementation.Type()


class Service:
    nri = False  # NRI mode (shim.app.nri_front): container keys the kubelet writes are the kubelet's

    def __init__(self, cfg: Config, node, kubelet, audit: AuditLog, container_qos: ContainerMemoryQoS,
                 recorder=None, reconciler=None, monitor=None, metrics=None, *, version_pending: bool = False,
                 update_follower=None):
        self.cfg = cfg
        self.node = node
        self.kubelet = kubelet
        self.audit = audit
        self.container_qos = container_qos
        # enforce or observe, shared by the rewriter and every cgroup writer (set_mode switches it)
        self.rollout = container_qos.rollout
        self.recorder = recorder  # shim.evidence.recorder.Recorder with --record
        self.hooks = build_request_hooks(container_qos, [recorder] if recorder is not None else [])
        self.proxy = None
        # shim.node.reconciler.Reconciler: pod/QoS/node memory.min, fed by an observer
        self.reconciler = reconciler
        if reconciler is not None:
            self.hooks.observers.append(reconciler.observer)
            # the removals are parsed on the reconciler's thread, which tells the rewriter
            container_qos.forget_from_calls = False
            reconciler.removal_listeners.append(container_qos.forget)
        # shim.guard.update_follow.UpdateFollower: writes a container's memory.* values after an
        # update on a runtime that leaves unified out of updates (CRI-O before 1.36)
        self.update_follower = update_follower
        if update_follower is not None:
            self.hooks.observers.append(update_follower)
        # shim.guard.monitor.Monitor: samples containers' memory.* files, runs the memory.high guard
        self.monitor = monitor
        # --kubelet-version auto: shim.node.kubelet_version.KubeletVersionWatcher, started after the socket
        self.version_pending = version_pending
        self.version_watcher = None
        # shim.evidence.metrics.Metrics (--metrics-address): CRI counters from an observer, the rewrite timed
        self.metrics = metrics
        if metrics is not None:
            self.hooks.observers.append(metrics.observer)
            self.hooks.time_rewrites(metrics.rewrite_timer)
        # the hooks' work after each answer, in batches off the transport's thread (from start)
        self.finisher: CallFinisher | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> "Service":
        kubelet, capacity, page, node, v2 = read_node(cfg)
        audit = start_audit(cfg)
        writes, owners, version_how, pending = kubelet_ownership(cfg, kubelet)
        rollout = Rollout(cfg.mode)
        qos = build_container_qos(node, cfg.policy, audit.emit, cgroup_v2=v2, cgroup_root=cfg.cgroup_root,
                                  ownership=owners, rollout=rollout, **class_options(cfg))
        backend = protobuf_backend()
        if backend != "upb":
            log.warning("protobuf backend is %r, not upb: each rewrite costs ~1 ms instead of ~10 us", backend)
        start_record = {
            "event": "start",
            "rollout": rollout.mode,
            "listen": cfg.listen,
            "upstream": cfg.upstream,
            "capacity": capacity,
            "allocatable": node.allocatable,
            "factor": node.factor,
            "page_size": page,
            "policy": cfg.policy.value,
            "cgroup_v2": v2,
            "kubelet_config": kubelet.source or None,
            "cgroup_driver": kubelet.cgroup_driver,
            "kubelet_memory_qos_gate": kubelet.memory_qos_gate,
            "kubelet_version": None if writes.version is None else "%d.%d" % writes.version,
            "kubelet_version_source": version_how,
            "kubelet_writes": writes.summary(),
            "kubelet_assumptions": list(writes.assumptions),
            "ownership": owners.as_dict(),
        }
        audit.emit(start_record)
        log.info("node: capacity %d, allocatable %d, factor %s, page %d, policy %s, cgroup v2 %s",
                 capacity, node.allocatable, node.factor, page, cfg.policy.value, v2)
        if pending:
            log.info("decided without the kubelet version (until `kubelet --version` answers, then "
                     "revisited): %s", writes.summary())
        else:
            log.info("%s (version: %s)", writes.summary(), version_how)
        for assumption in writes.assumptions:
            log.warning("kubelet: %s", assumption)
        log_ownership(owners, v2, cfg.cgroup_root)
        say_mode(rollout)
        recorder = start_recorder(cfg, node, kubelet, capacity, v2, writes.version) \
            if cfg.record else None
        from shim.node.reconciler import build_reconciler

        reconciler = build_reconciler(cfg, kubelet, node, audit.emit, ownership=owners, rollout=rollout)
        if reconciler is not None:
            reconciler.state.unprotected = unprotected_classes(qos.class_settings)
            qos.recorded_class = lambda cid: reconciler.view.classes.get(cid)
        from shim.guard.monitor import build_monitor

        monitor = build_monitor(cfg, kubelet, audit.emit, container_qos=qos, reconciler=reconciler,
                                rollout=rollout) if v2 else None
        follower = None
        if v2:
            from shim.guard.update_follow import UpdateFollower

            follower = UpdateFollower(cgroup_root=cfg.cgroup_root, kubelet=kubelet, emit=audit.emit,
                                      container_qos=qos, page_size=page, reconciler=reconciler, rollout=rollout)
        metrics = None
        if cfg.metrics_address:  # prometheus_client costs ~2.5 MiB of RSS: only when used
            from shim.evidence.metrics import build_metrics

            metrics = build_metrics(cfg, audit=audit, monitor=monitor, reconciler=reconciler, recorder=recorder,
                                    rollout=rollout)
        return cls(cfg, node, kubelet, audit, qos, recorder=recorder, reconciler=reconciler,
                   monitor=monitor, metrics=metrics, version_pending=pending, update_follower=follower)

    async def start(self) -> None:
        mode = self.cfg.socket_mode or (0o660 if self.cfg.socket_group else 0o600)
        self.finisher = CallFinisher(self.hooks.after, max_pending=self.cfg.finish_max_pending).start()
        self.hooks.defer_to(self.finisher)
        if self.metrics is not None:
            self.metrics.attach(finisher=self.finisher)
        from shim.transport.loop_thread import ThreadedProxy, uvloop_factory
        from shim.transport.relay import H2Limits, RelayProxy

        cfg = self.cfg
        limits = H2Limits(max_header_block=cfg.h2_max_header_block, max_continuations=cfg.h2_max_continuations,
                          max_frame_size=cfg.h2_max_frame_size,
                          max_concurrent_streams=cfg.h2_max_concurrent_streams, reset_rate=cfg.h2_reset_rate,
                          reset_burst=cfg.h2_reset_burst, preface_timeout=cfg.h2_preface_timeout,
                          idle_timeout=cfg.h2_idle_timeout)
        self.proxy = RelayProxy(cfg.listen, cfg.upstream, self.hooks, methods=CRI_METHODS,
                                socket_mode=mode, socket_group=cfg.socket_group, limits=limits,
                                max_connections=cfg.max_connections,
                                max_connections_per_peer=cfg.max_connections_per_peer)
        if self.metrics is not None:
            self.metrics.attach(relay=self.proxy)  # its limit_hits
        factory = uvloop_factory()  # the relay's cost is mostly event-loop work: run it on uvloop
        if factory is not None:
            self.proxy = ThreadedProxy(self.proxy, factory, name="cri-relay")
        if self.metrics is not None:
            self.metrics.attach(transport=self.proxy)
        await self.proxy.start()  # the transport says where it serves and forwards to
        warn_missing_upstream(self.cfg.upstream)
        # everything below happens while calls are already forwarded
        if self.version_pending:  # the search may take seconds on a cold node
            from shim.node.kubelet_version import KubeletVersionWatcher

            self.version_watcher = KubeletVersionWatcher(self.kubelet_version_known).start()
        if self.reconciler is not None:
            self.reconciler.start()  # rebuilds the node state from the runtime first
        if self.monitor is not None:
            self.monitor.start()
        if self.metrics is not None:
            self.start_metrics_server()

    async def stop(self) -> None:
        if self.version_watcher is not None:
            self.version_watcher.stop(timeout=1.0)
        if self.proxy is not None:
            await self.proxy.stop(grace=5)
        if self.finisher is not None:  # the calls' audit records, recordings and events before their writers stop
            self.finisher.stop()
            self.hooks.defer_to(None)
        if self.reconciler is not None:
            self.reconciler.stop()
        if self.monitor is not None:
            self.monitor.stop()
        if self.metrics is not None:
            self.metrics.close()
        if self.recorder is not None:
            self.recorder.close()
        self.audit.close()

    def reopen_files(self) -> None:
        """SIGHUP: the audit log and the recorder reopen their files by name before their next
        record (after logrotate renamed them). Only flags and queue marks: no I/O here."""
        self.audit.reopen()
        if self.recorder is not None:
            self.recorder.reopen()

    def kubelet_version_known(self, version: tuple[int, int], how: str) -> None:
        """The kubelet's version was found after start (on the watcher's thread): recompute who
        owns what and hand it to the rewriter (from its next call), the reconciler (recomputed
        on its thread), the guard and the recorder's next file; audit what changed."""
        from shim.node.kubelet import CONTAINER_HIGH
        from shim.guard.monitor import guard_for_ownership, kubelet_owns_high

        before = self.container_qos.ownership
        writes, owners, _, _ = kubelet_ownership(self.cfg, self.kubelet, version, nri=self.nri)
        changed = {what: {"from": before.owners[what], "to": who, "why": owners.reasons[what]}
                   for what, who in owners.owners.items() if before is not None and before.owners[what] != who}
        self.version_pending = False
        self.container_qos.set_ownership(owners)
        if self.reconciler is not None:
            self.reconciler.set_ownership(owners, "kubelet version known")
        if self.monitor is not None and CONTAINER_HIGH in changed:
            self.monitor.guard = guard_for_ownership(self.cfg, owners)
            self.monitor.kubelet_high = kubelet_owns_high(owners)
        if self.recorder is not None:  # the files after the next rotation say it
            self.record_setting("kubelet-version", "%d.%d" % version, kubelet_version="%d.%d" % version)
        self.audit.emit({
            "event": "kubelet-version-known",
            "kubelet_version": "%d.%d" % version,
            "kubelet_version_source": how,
            "kubelet_writes": writes.summary(),
            "kubelet_assumptions": list(writes.assumptions),
            "changed": changed,
            "ownership": owners.as_dict(),
            # created through the shim so far, each decided without the version
            "containers_decided_without_version": len(self.container_qos.containers),
        })
        log.info("kubelet version %d.%d: %s", version[0], version[1], writes.summary())
        if not changed:
            log.info("ownership unchanged by the kubelet's version")
        for what, c in changed.items():
            log.warning("ownership changed now that the kubelet's version is known: %s %s -> %s (%s)",
                        what, c["from"], c["to"], c["why"])

    def set_mode(self, mode: str, why: str) -> bool:
        """Switch between enforce and observe while running (any thread): one assignment the
        rewriter, the NRI handler and every cgroup writer see from their next call or write;
        audited. Going to enforce, the reconciler makes a full pass at once from what the files
        hold. Whether the mode changed."""
        before = self.rollout.mode
        if not self.rollout.set(mode):
            return False
        self.audit.emit({"event": "mode", "from": before, "to": mode, "why": why})
        self.record_setting("mode", mode)
        log.warning("mode %s -> %s (%s)", before, mode, why)
        say_mode(self.rollout)
        if mode != OBSERVE and self.reconciler is not None:
            self.reconciler.enforce_now(f"mode {before} -> {mode}")
        return True

    def record_setting(self, name: str, value, **legacy) -> None:
        """A deciding setting changed while running: the recorder's next file (after a rotation
        or a reopen) says it in its header; the current file keeps the one it started with."""
        if getattr(self, "recorder", None) is None:
            return
        header = self.recorder.header
        shim = header.get("shim", {})
        self.recorder.header = {**header, "shim": {**shim, **legacy, "settings": {**shim.get("settings", {}),
                                                                                 name: value}}}

    # -- /healthz and /readyz
    def side_threads(self) -> tuple:
        return (self.audit, self.finisher, self.reconciler, self.monitor, self.recorder, self.version_watcher)

    def health(self) -> list[str]:
        """/healthz: what is wrong with the process (empty: healthy): a side thread ended, the
        relay's event loop ended, the reconciler or the monitor stuck on an item."""
        from shim.evidence.probes import dead_threads

        problems = dead_threads(self.side_threads())
        if self.proxy is not None and not getattr(self.proxy, "alive", True):
            problems.append("the CRI relay's event loop thread is not running")
        for watch in getattr(self, "_stuck", ()):
            if (p := watch.problem()) is not None:
                problems.append(p)
        return problems

    def readiness(self) -> list[str]:
        """/readyz: why the shim does not do its job yet (empty: ready): the socket not served,
        the runtime's socket not accepting, the reconciler's first rebuild not done."""
        from shim.evidence.probes import unix_socket_problem
        from shim.transport.endpoints import socket_path

        problems = [] if self.proxy is not None else ["the CRI socket is not served yet"]
        problem = unix_socket_problem(socket_path(self.cfg.upstream))
        if problem is not None:
            problems.append(f"the runtime is unreachable (upstream {self.cfg.upstream}): {problem}")
        if self.reconciler is not None and not self.reconciler.resyncs:
            problems.append("the reconciler's first rebuild from the runtime is not done yet")
        return problems

    def start_metrics_server(self) -> None:
        """Serve /metrics, /healthz and /readyz. Metrics are not worth the node: a bind failure
        is logged and audited, the shim keeps serving the kubelet."""
        from shim.evidence.metrics import is_loopback, split_address
        from shim.evidence.probes import StuckWatch

        self._stuck = [StuckWatch(w) for w in (self.reconciler, self.monitor) if w is not None]
        self.metrics.attach(health=self.health, ready=self.readiness)
        address = self.cfg.metrics_address
        try:
            host, port = self.metrics.serve(address)
        except (OSError, ValueError) as e:
            log.error("metrics: cannot serve on %s: %s; running without /metrics", address, e)
            self.audit.emit({"event": "metrics-error", "address": address, "error": str(e)[:500]})
            return
        if not is_loopback(split_address(address)[0]):
            log.warning("metrics on %s are reachable from the network: they name pods and containers", address)
        base = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        log.info("metrics on %s/metrics, health on %s/healthz and %s/readyz", base, base, base)
        self.audit.emit({"event": "metrics", "address": f"{host}:{port}"})


def say_mode(rollout: Rollout) -> None:
    if rollout.observe:
        log.warning("mode observe: calls are decided and audited, forwarded unchanged; no cgroup file is written")


def start_recorder(cfg: Config, node, kubelet, capacity: int, cgroup_v2: bool, kubelet_version=None):
    """--record: the trace recorder, its header holding the node facts and the settings the
    shim decides with (so a replay of the recording reproduces its audit records)."""
    from shim import __version__
    from shim.app.decides import header_settings
    from shim.evidence.recorder import Recorder, read_kubelet_config_doc, shim_header
    from shim.node.kubelet import fmt_version

    header = shim_header(
        version=__version__,
        mem_total_bytes=capacity,
        page_size=node.page_size,
        cgroup_driver=kubelet.cgroup_driver,
        kubelet_config=read_kubelet_config_doc(kubelet.source or None),
        allocatable=node.allocatable,
        factor=node.factor,
        policy=cfg.policy.value,
        cgroup_v2=cgroup_v2,
        listen=cfg.listen,
        upstream=cfg.upstream,
        methods=cfg.record_methods or "default",
        kubelet_version=None if kubelet_version is None else "%d.%d" % kubelet_version,
        settings=header_settings(cfg, {"node-allocatable": node.allocatable, "factor": node.factor,
                                       "page-size": node.page_size, "kubelet-version": fmt_version(kubelet_version)}),
    )
    return Recorder(cfg.record, header, max_bytes=cfg.record_max_bytes, keep=cfg.record_keep,
                    methods=cfg.record_methods).start()
