"""`memqos-shim nri`: the shim as an NRI plugin, over the same decision, reconciler, audit,
metrics, guard and reclaim as `serve`, from the same config file.

What differs from `serve`: no CRI socket and no runtime client. Containers get their values
from the plugin's answers (``shim.container.nri_handler.NriMemoryQoS``); the reconciler is
fed by the runtime's NRI messages (events and the Synchronize listing, handed over as typed
events and one ``Rebuild``) and writes nothing before the first Synchronize; its periodic
resync recomputes from that listing plus the events since (repairing drift), and the init
container rule is fed by the container states NRI messages carry (StopContainer, StateChange)
instead of ContainerStatus polls.

The plugin runs on the main event loop; the heartbeat file (``health-file``) says
``registered`` while the runtime has the plugin registered, ``connecting`` otherwise. Start-up
order: what answering the runtime needs (settings, node facts, audit, reconciler, handler,
confirmer) is built first; the plugin then connects and registers while the monitor and the
metrics -- whose imports registration does not need -- are built in a thread.
"""
from __future__ import annotations

import asyncio
import logging
import threading

from shim.app.config import Config
from shim.app.config_classes import class_options, unprotected_classes
from shim.app.service import (Service, kubelet_ownership, log_ownership, protobuf_backend, read_node, say_mode,
                               start_audit)
from shim.container.nri_handler import NriMemoryQoS
from shim.effects.rollout import Rollout
from shim.evidence.audit import AuditLog

log = logging.getLogger(__name__)

CONNECTING = "connecting"
EARLY_RECORDS = 100_000  # audit records kept for the metrics until they are built (a bound far above a start)


def build_nri_reconciler(cfg: Config, kubelet, node, emit, ownership=None, rollout=None):
    """The reconciler of NRI mode: no runtime client; it waits for the first listing."""
    if not cfg.reconcile:
        return None
    from shim.node.reconciler import Reconciler

    return Reconciler(cgroup_root=cfg.cgroup_root, kubelet=kubelet, policy=cfg.policy, capacity=node.capacity,
                      page_size=node.page_size, emit=emit, client_factory=None,
                      resync_interval=cfg.resync_interval, ownership=ownership,
                      systemd_writes=cfg.systemd_writes, allocatable=node.allocatable, wait_for_listing=True,
                      rollout=rollout)


def listing_rebuild(capacity: int):
    """Synchronize's events -> the reconciler's Rebuild (made into a Snapshot on its thread)."""
    from shim.node.reconciler import Rebuild
    from shim.node.state import listing_snapshot

    def rebuild(events: list):
        return Rebuild(lambda state, gen: listing_snapshot(events, state, capacity, gen), "nri-synchronize")

    return rebuild


class NriService(Service):
    """The parts of `serve` that do not depend on a CRI socket, around an NRI plugin.
    ``container_qos`` is the NRI handler (it has the rewriter's ``ownership`` and
    ``containers``), so the kubelet-version and metrics wiring of ``Service`` apply as they are."""

    heartbeat_interval = 5.0  # seconds between heartbeats (health-file)
    nri = True

    def __init__(self, cfg: Config, node, kubelet, audit: AuditLog, handler: NriMemoryQoS, reconciler=None,
                 monitor=None, metrics=None, *, version_pending: bool = False, cgroup_v2: bool = True):
        from shim.nri.plugin import NriPlugin

        self.cfg, self.node, self.kubelet, self.audit = cfg, node, kubelet, audit
        self.container_qos = self.handler = handler
        self.rollout = handler.rollout
        self.recorder = None
        self.proxy = None
        self.finisher = None  # (serve's call-finisher: the NRI handler's work is in its own calls)
        self.reconciler, self.monitor, self.metrics = reconciler, monitor, metrics
        self.cgroup_v2 = cgroup_v2
        self._early: list[dict] = []
        self._early_sink = None
        self._early_lock = threading.Lock()
        if metrics is None and cfg.metrics_address:
            audit.add_listener(self._keep_early)
        self.version_pending = version_pending
        self.version_watcher = None
        self.plugin = NriPlugin(handler, index="%02d" % cfg.nri_index, socket_path=cfg.nri_socket)
        self.heartbeat = None
        self._beating: asyncio.Future | None = None
        self._running: asyncio.Future | None = None
        self._watching: asyncio.Future | None = None
        self._stop = asyncio.Event()

    @classmethod
    def from_config(cls, cfg: Config) -> "NriService":
        kubelet, capacity, page, node, v2 = read_node(cfg)
        audit = start_audit(cfg)
        writes, owners, version_how, pending = kubelet_ownership(cfg, kubelet, nri=True)
        rollout = Rollout(cfg.mode)
        if protobuf_backend() != "upb":
            log.warning("protobuf backend is %r, not upb: each NRI answer costs ~1 ms instead of ~10 us",
                        protobuf_backend())
        audit.emit({
            "event": "start", "mode": "nri", "rollout": rollout.mode, "nri_socket": cfg.nri_socket, "nri_index": "%02d" % cfg.nri_index,
            "capacity": capacity, "allocatable": node.allocatable, "factor": node.factor, "page_size": page,
            "policy": cfg.policy.value, "cgroup_v2": v2, "kubelet_config": kubelet.source or None,
            "cgroup_driver": kubelet.cgroup_driver, "kubelet_memory_qos_gate": kubelet.memory_qos_gate,
            "kubelet_version": None if writes.version is None else "%d.%d" % writes.version,
            "kubelet_version_source": version_how, "kubelet_writes": writes.summary(),
            "kubelet_assumptions": list(writes.assumptions), "ownership": owners.as_dict(),
        })
        log.info("node: capacity %d, allocatable %d, factor %s, page %d, policy %s, cgroup v2 %s",
                 capacity, node.allocatable, node.factor, page, cfg.policy.value, v2)
        log_ownership(owners, v2, cfg.cgroup_root)
        say_mode(rollout)
        reconciler = build_nri_reconciler(cfg, kubelet, node, audit.emit, ownership=owners, rollout=rollout)
        reason = "" if v2 else f"{cfg.cgroup_root}/cgroup.controllers not found (not cgroup v2)"
        confirmer = None
        if v2 and cfg.nri_confirm != "off":
            from shim.container.nri_confirm import NriConfirmer

            confirmer = NriConfirmer(cgroup_root=cfg.cgroup_root, kubelet=kubelet, emit=audit.emit, rollout=rollout,
                                     mode=cfg.nri_confirm, window=cfg.nri_confirm_window,
                                     max_pending=cfg.nri_confirm_queue)
        handler = NriMemoryQoS(node, cfg.policy, audit.emit, ownership=owners, enabled=v2, disabled_reason=reason,
                               enqueue=reconciler.submit if reconciler is not None else None,
                               rebuild=listing_rebuild(capacity) if reconciler is not None else None,
                               rollout=rollout, confirmer=confirmer, **class_options(cfg))
        if reconciler is not None:
            reconciler.state.unprotected = unprotected_classes(handler.class_settings)
        # the monitor (guard, reclaim) and the metrics are built in start(), off the loop, once the
        # plugin is on its way to registering: registration does not need their imports
        return cls(cfg, node, kubelet, audit, handler, reconciler=reconciler, version_pending=pending,
                   cgroup_v2=v2)

    def build_side(self) -> None:
        """The monitor and the metrics (what registration does not need: their imports --
        prometheus_client, http.server, the guard -- take a while on a slow node). Run in an
        executor thread while the plugin connects and registers on the loop."""
        cfg, handler = self.cfg, self.handler
        if self.monitor is None and self.cgroup_v2:
            from shim.guard.monitor import build_monitor

            self.monitor = build_monitor(cfg, self.kubelet, self.audit.emit, container_qos=handler,
                                         reconciler=self.reconciler, rollout=self.rollout)
        if handler.confirmer is not None and self.monitor is not None:
            handler.confirmer.guarded = self.monitor.has_episode  # the guard's memory.high is left to it
        if self.metrics is None and cfg.metrics_address:
            from shim.evidence.metrics import build_metrics

            metrics = build_metrics(cfg, monitor=self.monitor, reconciler=self.reconciler, rollout=self.rollout)
            metrics.audit = self.audit
            with self._early_lock:  # the records so far, then every later one, each counted once
                for record in self._early:
                    metrics.on_audit(record)
                self._early, self._early_sink = [], metrics.on_audit
            self.metrics = metrics

    def _keep_early(self, record: dict) -> None:
        """The audit listener until the metrics exist (on the audit writer's thread): records
        are kept (at most EARLY_RECORDS) and counted once the metrics are built."""
        with self._early_lock:
            if self._early_sink is not None:
                self._early_sink(record)
            elif len(self._early) < EARLY_RECORDS:
                self._early.append(record)

    def state(self) -> str:
        return "registered" if self.plugin.registered else CONNECTING

    async def start(self) -> None:
        if self.cfg.health_file:
            from shim.evidence.health import Heartbeat

            self.heartbeat = Heartbeat(self.cfg.health_file, self.heartbeat_interval)
            self.heartbeat.beat(CONNECTING)
            self._beating = asyncio.ensure_future(self.heartbeat.run(self.state))
        if self.reconciler is not None:
            self.reconciler.start()  # idle until the first Synchronize
        if self.handler.confirmer is not None:
            self.handler.confirmer.start()
        from shim.nri.plugin import watch_loop

        self._watching = asyncio.ensure_future(watch_loop(self.plugin.stats))
        self._running = asyncio.ensure_future(self.plugin.run(self._stop))
        log.info("NRI plugin %02d-%s on %s", self.cfg.nri_index, self.plugin.name, self.cfg.nri_socket)
        await asyncio.get_running_loop().run_in_executor(None, self.build_side)  # the plugin registers meanwhile
        if self.version_pending:
            from shim.node.kubelet_version import KubeletVersionWatcher

            self.version_watcher = KubeletVersionWatcher(self.kubelet_version_known).start()
        if self.monitor is not None:
            self.monitor.start()
        if self.metrics is not None:
            self.metrics.attach(nri=self.plugin)
            self.start_metrics_server()

    def readiness(self) -> list[str]:
        """/readyz of NRI mode: the runtime has the plugin registered and its first Synchronize
        on this registration is handled."""
        if not self.plugin.registered:
            return [f"not registered with the runtime (NRI socket {self.cfg.nri_socket}"
                    + (f": {self.plugin.stats.last_error}" if self.plugin.stats.last_error else "") + ")"]
        protocol = self.plugin.protocol
        if protocol is None or not protocol.synchronized:
            return ["registered; the runtime's first Synchronize is not handled yet"]
        return []

    async def stop(self) -> None:
        self._stop.set()
        if self._running is not None:
            await asyncio.gather(self._running, return_exceptions=True)
        if self._watching is not None:
            self._watching.cancel()
            await asyncio.gather(self._watching, return_exceptions=True)
        if self._beating is not None:  # the file is removed: not alive any more
            self._beating.cancel()
            await asyncio.gather(self._beating, return_exceptions=True)
        if self.version_watcher is not None:
            self.version_watcher.stop(timeout=1.0)
        if self.reconciler is not None:
            self.reconciler.stop()
        if self.handler.confirmer is not None:
            self.handler.confirmer.stop()
        if self.monitor is not None:
            self.monitor.stop()
        if self.metrics is not None:
            self.metrics.close()
        self.audit.close()
