"""Pod-, QoS- and node-level memory.min / memory.low, kept right by a side thread.

The runtime applies the container-level ``unified`` keys; the pod, QoS-class and kubepods
cgroups belong to the kubelet and nobody sets their protection, yet the kernel caps a
container's protection by its ancestors'. This module writes them (reference section 2):

* pod cgroup: the pod's memory request (shim.node.state.pod_request);
* burstable QoS cgroup: the sum over Burstable pods; kubepods: Guaranteed + Burstable;
* kube-reserved / system-reserved cgroups: the reserved memory, when the kubelet enforces them
  and names their cgroups;
* the policy (named like the kubelet's memoryReservationPolicy) picks memory.min or memory.low
  per QoS class (compute_targets); ``None`` sets every managed value to 0;
* a scope the kubelet itself writes (a kubelet configured to, see shim.node.kubelet) is left
  to it: the shim neither writes nor zeroes it.

Flow: the proxy's observer (``ReconcilerObserver.finished``) only puts finished calls on a
``queue.SimpleQueue``. The reconciler thread drains the queue, updates the NodeState, computes
every target, and applies the differences: increases top-down (kubepods -> QoS -> pod),
then decreases bottom-up. Every write goes through shim.effects (validated paths, written
only when different) and is audited. At start (and when the upstream comes back) the state is
rebuilt from the runtime before anything is written; then a resync every ``resync_interval``
seconds re-lists the runtime and repairs drift.
"""
from __future__ import annotations

import logging
import queue
import time
from typing import Callable

from shim.decision import Policy, QoSClass
from shim.decision.node import POD, PlacedPod, Reserved, Target, node_targets
from shim.decision.protection import keep_protection
from shim.decision.quantity import allocatable_bound
from shim.effects import CgroupLayout, PathRefused, detect_driver, parse_value
from shim.effects.systemd import CgroupWriter
from shim.node.facts import KubeletFacts, is_cgroup_v2
from shim.cri.events import OBSERVED_METHODS, call_event
from shim.decision.events import EVENT_TYPES, ContainerRemoved, PodSandboxRemoved
from shim.node.state import NodeState
from shim.node.view import NodeView
from shim.transport.hooks import RpcCall
from shim.worker import Worker

log = logging.getLogger(__name__)

RETRY_INTERVAL = 2.0  # while the first rebuild from the runtime has not succeeded
REMOVALS = (ContainerRemoved, PodSandboxRemoved)  # the events removal_listeners are told
_REFUSED = object()  # a path the cgroup writer refused (already reported)


def compute_targets(
    state: NodeState,
    layout: CgroupLayout,
    policy: Policy,
    page_size: int,
    reserved: list[Reserved] = (),
    check: Callable[[str], object] | None = None,
    kubelet_owns: frozenset[str] | set[str] = frozenset(),
    capacity: int = 0,
    allocatable: int = 0,
) -> tuple[dict[tuple[str, str], Target], list[tuple[str, str]]]:
    """Every managed (path, file) -> Target (shim.decision.node.node_targets, which has the
    policy), and the refusals ((key, reason)): pods whose cgroup_parent is not where the layout
    puts them, or whose path ``check(path)`` refuses (PathRefused, e.g. CgroupFS.validate:
    symlinks), are left out. Values are capped at what the node can give (``allocatable`` for
    pods, QoS and kubepods, ``capacity`` for reserved: node_targets)."""
    refusals: list[tuple[str, str]] = []
    pods = []
    for pod in sorted(state.pods.values(), key=lambda p: p.uid):
        try:
            qos, path = layout.pod_from_parent(pod.cgroup_parent, pod.uid)
            if check is not None:
                check(path)
        except PathRefused as e:
            refusals.append((f"pod/{pod.uid}/{pod.cgroup_parent}", f"pod {pod.label()}: {e}"))
            continue
        req = state.request(pod) if pod.active and qos is not QoSClass.BESTEFFORT else None
        pods.append(PlacedPod(pod, qos, path, req))
    targets = node_targets(pods, layout.kubepods, layout.qos(QoSClass.BURSTABLE), layout.qos(QoSClass.BESTEFFORT),
                           policy, page_size, reserved, kubelet_owns, capacity=capacity, allocatable=allocatable)
    return targets, refusals


def reserved_cgroups(kubelet: KubeletFacts, layout: CgroupLayout) -> tuple[list[Reserved], list[tuple[str, str]]]:
    out, refusals = [], []
    for kind, name, amount in (
        ("kube-reserved", kubelet.kube_reserved_cgroup, kubelet.kube_reserved),
        ("system-reserved", kubelet.system_reserved_cgroup, kubelet.system_reserved),
    ):
        if kind in kubelet.enforce_node_allocatable and name:
            try:
                out.append(Reserved(kind, layout.reserved(name), amount))
            except PathRefused as e:
                refusals.append((f"{kind}/{name}", f"{kind} cgroup: {e}"))
    return out, refusals


# -- the observer on the CRI path ------------------------------------------------------
class _Resync:
    def __init__(self, reason: str, fresh: bool, forget: bool = False):
        self.reason = reason
        self.fresh = fresh
        self.forget = forget  # what the files hold is read again, not taken from the last pass


class Rebuild:
    """A listing from another source than the runtime client (NRI's Synchronize):
    ``make(state, gen)`` gives the Snapshot the node state is rebuilt from, on the reconciler's
    thread, in queue order with the events around it; a full pass follows (``reason``)."""

    def __init__(self, make: Callable, reason: str):
        self.make = make
        self.reason = reason


class _NewOwnership:
    def __init__(self, ownership, reason: str):
        self.ownership = ownership
        self.reason = reason


class ReconcilerObserver:
    """The HookChain observer: finished() only enqueues (never parses, never blocks); the
    call's event (``shim.cri.events``) is made on the reconciler's thread."""

    def __init__(self, q: queue.SimpleQueue):
        self._q = q
        self._down = False
        self._down_seen = False  # wants()' own view of it, on the transport's thread

    def wants(self, call: RpcCall) -> bool:
        """Whether ``finished`` has something to do with the call, asked on the transport's
        thread before the call is handed over (``finished`` may run later): an observed method,
        an UNAVAILABLE, and the first call that succeeds after one (it asks for the resync)."""
        code = call.code
        if code == "OK":
            if self._down_seen:
                self._down_seen = False
                return True
            return call.method in OBSERVED_METHODS
        if code == "UNAVAILABLE":
            self._down_seen = True
            return True
        return False

    def finished(self, call: RpcCall) -> None:
        code = call.code
        if code == "OK":
            if self._down:
                self._down = False
                self._q.put(_Resync("upstream-reconnected", True))
            if call.method in OBSERVED_METHODS:
                self._q.put(call)
        elif code == "UNAVAILABLE":
            self._down = True


# -- the reconciler --------------------------------------------------------------------
class Reconciler(Worker):
    """The side thread (``memqos-reconciler``) that keeps pod/QoS/node protection right. After
    each change it applies it publishes ``view`` (a NodeView) for other threads to read."""

    batch = True

    def __init__(
        self,
        *,
        cgroup_root: str,
        kubelet: KubeletFacts,
        policy: Policy,
        capacity: int,
        page_size: int,
        emit: Callable[[dict], None],
        client_factory: Callable[[], object] | None = None,
        resync_interval: float = 30.0,
        ownership=None,
        systemd_writes: str = "cgroupfs",
        allocatable: int | None = None,
        wait_for_listing: bool = False,
        rollout=None,
    ):
        super().__init__("memqos-reconciler", logger=log, label="reconciler", report_error=self._report_error)
        self.cgroup_root = cgroup_root
        self.kubelet = kubelet
        self.policy = policy
        self.page_size = page_size
        self.capacity = capacity
        # None: capacity - kubeReserved - systemReserved, as shim.node.facts.node_facts has it
        self.allocatable = max(0, capacity - kubelet.kube_reserved - kubelet.system_reserved) \
            if allocatable is None else allocatable
        self.resync_interval = resync_interval
        # scopes (pod, qos, kubepods, reserved) the kubelet writes itself: left to it
        if ownership is None:
            from shim.node.kubelet import kubelet_writes, ownership as owners_for

            ownership = owners_for(kubelet_writes(kubelet, None), policy)
        self.ownership = ownership
        self.kubelet_scopes = ownership.kubelet_scopes()
        self._emit = emit
        self._client_factory = client_factory
        self.client = None
        self.state = NodeState(capacity)
        self.view = NodeView()  # replaced (never mutated) after each change applied
        # how writes are made (cgroupfs, or systemd's SetUnitProperties on systemd-driver nodes)
        # (observe, shim.effects.rollout: every pass decides and audits what it would write, and
        # remembers it as written, as enforce would)
        self.fs = CgroupWriter(cgroup_root, (), emit=emit, mode=systemd_writes, ceiling=capacity, rollout=rollout)
        self.observer = ReconcilerObserver(self._queue)
        # told each removal event made from an observed call, on this thread (the rewriter forgets
        # its containers from them: ``ContainerMemoryQoS.forget``)
        self.removal_listeners: list[Callable[[ContainerRemoved | PodSandboxRemoved], None]] = []
        self.layout: CgroupLayout | None = None
        self.reserved: list[Reserved] = []
        self.recovered = False
        self.resyncs = 0  # completed resyncs (tests, metrics)
        self.known: dict[tuple[str, str], int] = {}  # what each file held after our last look
        self.written: dict[tuple[str, str], int] = {}  # non-zero values this process wrote -> level
        self.pod_files: dict[tuple[str, str], str] = {}  # pod-level files of the last pass -> pod uid
        self.kept = False  # a pass has kept protection in force since start (the first one floors no sum)
        self._refused: set[str] = set()
        self._next_at = 0.0  # the next periodic resync (time.monotonic())
        # without a runtime client: write nothing before a listing (``Rebuild``) arrives
        self.wait_for_listing = wait_for_listing
        self.listings = 0  # Rebuilds applied

    # -- lifecycle
    def stop(self, timeout: float = 5.0) -> bool:
        if not super().stop(timeout):
            return False
        self.fs.close()
        if self.client is not None:
            try:
                self.client.close()
            except Exception:
                pass
        return True

    def request_resync(self, reason: str = "requested", fresh: bool = False) -> None:
        self._queue.put(_Resync(reason, fresh))

    def enforce_now(self, reason: str) -> None:
        """The shim went from observe to enforce: a full pass at once, from what the files really
        hold (the values observe took as written were not)."""
        self._queue.put(_Resync(reason, False, forget=True))

    def submit(self, item) -> None:
        """Queue a node event (``shim.decision.events``) or a ``Rebuild``: from any thread, never waits."""
        self._queue.put(item)

    def set_ownership(self, ownership, reason: str = "ownership changed") -> None:
        """Recompute with a new Ownership (shim.node.kubelet; e.g. once the kubelet's version is
        known): applied on the reconciler's thread; when the scopes left to the kubelet changed,
        a resync follows (``reason`` is its trigger in the audit records)."""
        self._queue.put(_NewOwnership(ownership, reason))

    # -- the thread
    def on_start(self) -> None:
        if self._client_factory is not None:
            try:
                self.client = self._client_factory()
            except Exception as e:
                self._error("client", f"cannot create the runtime client: {e}")
        if self.kubelet_scopes:
            log.info("left to the kubelet (it writes them itself): %s", ", ".join(sorted(self.kubelet_scopes)))
        self._guard(self._resync, "startup", True)
        self._next_at = time.monotonic() + self._interval()
        self._publish()

    def wait_time(self) -> float:
        return max(0.0, self._next_at - time.monotonic())

    def handle(self, items: list) -> None:
        """One batch: everything queued since the last (observed calls, resync requests)."""
        dirty, resync, refresh = False, None, []
        for it in items:
            if isinstance(it, _Resync):
                if it.forget:
                    self.known.clear()
                if resync is None or (it.fresh and not resync.fresh):
                    resync = it
            elif isinstance(it, _NewOwnership):
                if self._take_ownership(it.ownership) and resync is None:
                    resync = _Resync(it.reason, False)
            elif isinstance(it, Rebuild):
                if self._guard(self._rebuild, it):
                    resync = _Resync(it.reason, True)
            elif isinstance(it, EVENT_TYPES):  # a front end that makes its own events (NRI)
                changed, uid = self._guard(self.state.apply, it) or (False, None)
                dirty |= changed
            elif isinstance(it, RpcCall):
                changed, uid = self._guard(self._apply, it) or (False, None)
                dirty |= changed
                if uid is not None and uid not in refresh:
                    refresh.append(uid)
        if self.stopping:
            return
        if refresh and self.client is not None:
            for uid in refresh:  # once per pod and batch, after the batch's calls
                dirty |= bool(self._guard(self._refresh_pod, uid))
        if resync is not None or time.monotonic() >= self._next_at:
            r = resync or _Resync("periodic", False)
            self._guard(self._resync, r.reason, r.fresh or not self.recovered)
            self._next_at = time.monotonic() + self._interval()
        elif dirty:
            self._guard(self._reconcile, "event", False)
        self._publish()

    def _take_ownership(self, ownership) -> bool:
        """Whether the scopes left to the kubelet changed."""
        self.ownership = ownership
        scopes = ownership.kubelet_scopes()
        if scopes == self.kubelet_scopes:
            return False
        log.info("left to the kubelet now: %s (before: %s)", ", ".join(sorted(scopes)) or "nothing",
                 ", ".join(sorted(self.kubelet_scopes)) or "nothing")
        self.kubelet_scopes = scopes
        return True

    def _publish(self) -> None:
        """Replace ``view`` when the containers of the node state changed."""
        view = NodeView.of(self.state)
        if view != self.view:
            self.view = view

    def _interval(self) -> float:
        return self.resync_interval if self.recovered else min(self.resync_interval, RETRY_INTERVAL)

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # the thread must survive anything
            log.debug("reconciler: %s failed", getattr(fn, "__name__", fn), exc_info=True)
            self._error(getattr(fn, "__name__", "reconciler"), f"{e.__class__.__name__}: {e}")
            return None

    def _report_error(self, key: str, message: str) -> None:
        self._emit({"event": "reconciler-error", "what": key, "error": message[:500]})

    # -- state
    def _apply(self, call: RpcCall) -> tuple[bool, str | None]:
        """(state changed, uid of a pod whose containers' states should be asked for)."""
        event = call_event(call)
        if event is None:
            return False, None
        if type(event) in REMOVALS:
            for listener in self.removal_listeners:
                self._guard(listener, event)
        return self.state.apply(event)

    def _rebuild(self, it: Rebuild) -> bool:
        self.state.rebuild(it.make(self.state, self.state.snap_gen + 1))
        self.listings += 1
        return True

    def _refresh_pod(self, uid: str) -> bool:
        """Ask the runtime for the state of the pod's containers that had not finished when
        last seen (for the init-container rule: created_at / finished_at)."""
        from shim.node.runtime_client import RuntimeUnavailable

        pod = self.state.pods.get(uid)
        if pod is None:
            return False
        changed = False
        for c in list(pod.containers.values()):
            if c.finished_at:
                continue
            t = time.time_ns()
            try:
                st = self.client.container_status(c.id)
            except RuntimeUnavailable as e:
                self._error("refresh", f"ContainerStatus {c.id[:12]}: {e}")
                return changed
            if st is not None:
                changed |= self.state.observe_status(st, t, time.time_ns())
        return changed

    def _resync(self, reason: str, fresh: bool) -> None:
        if not is_cgroup_v2(self.cgroup_root):  # cgroup v1: nothing will ever be written here
            self._check_tree()
            self.resyncs += 1
            return
        if self.client is None and self.wait_for_listing and not self.listings:
            self.say_idle("waiting for the runtime's listing (NRI Synchronize): nothing is written before it")
            return
        if self.client is not None:  # (NRI mode has none: the runtime client's imports are not needed there)
            from shim.node.runtime_client import RuntimeUnavailable, take_snapshot

            try:
                snap = take_snapshot(self.client, None if fresh else self.state, self.capacity,
                                     self.state.snap_gen + 1)
            except RuntimeUnavailable as e:
                self._error("resync", f"resync ({reason}) failed, state kept: {e}", every=30.0)
                if self.recovered:  # still apply what the observed calls changed, repair drift
                    self._reconcile(reason, True)
                return
            self.state.rebuild(snap)
        first = not self.recovered
        self.recovered = True
        self.resyncs += 1
        writes = self._reconcile(reason, True)
        if first or writes or reason != "periodic":
            self._emit({"event": "resync", "reason": reason, "pods": len(self.state.pods),
                        "containers": len(self.state.container_pod), "writes": writes,
                        "source": "runtime" if self.client is not None else
                        "listing and events" if self.listings else "observed calls"})

    # -- cgroups
    def on_idle(self, reason: str) -> None:
        """Said once (log and audit) when the reconciler goes idle, with why."""
        log.warning("pod/QoS/node memory protection is idle: %s", reason)
        self._emit({"event": "reconciler-idle", "reason": reason})

    def on_active(self) -> None:
        """Said once (log and audit) when the reconciler is active again."""
        log.info("pod/QoS/node memory protection is active (%s driver)", self.layout.driver)
        self._emit({"event": "reconciler-active", "driver": self.layout.driver,
                    "kubepods": self.fs.abspath(self.layout.kubepods), "policy": self.policy.value,
                    "writes": self.fs.via,
                    **({"left_to_kubelet": sorted(self.kubelet_scopes)} if self.kubelet_scopes else {})})

    def _check_tree(self) -> bool:
        k = self.kubelet
        if not is_cgroup_v2(self.cgroup_root):
            self.say_idle(f"{self.cgroup_root} is not a cgroup v2 hierarchy (no cgroup.controllers): "
                           "nothing is written on cgroup v1")
            return False
        if not k.cgroups_per_qos:
            self.say_idle("the kubelet runs with cgroupsPerQOS=false: there are no QoS cgroups to protect")
            return False
        driver = k.cgroup_driver if k.source else detect_driver(self.cgroup_root, k.cgroup_root)
        if driver is None:
            self.say_idle(f"no kubepods cgroup under {self.cgroup_root} (kubelet not started yet?)")
            return False
        if self.layout is None or self.layout.driver != driver:
            try:
                self.layout = CgroupLayout(driver, k.cgroup_root)
            except (ValueError, PathRefused) as e:
                self.say_idle(str(e))
                return False
            self.reserved, refusals = reserved_cgroups(k, self.layout)
            for key, why in refusals:
                self._refuse(key, why)
            self.fs.set_allowed([self.layout.kubepods] + [r.path for r in self.reserved])
            self.fs.set_driver(driver, [r.path for r in self.reserved])
        if not self.fs.exists(self.layout.kubepods):
            self.say_idle(f"the kubepods cgroup {self.fs.abspath(self.layout.kubepods)} does not exist "
                           "(or is not a directory)")
            return False
        self.say_idle(None)
        return True

    def _refuse(self, key: str, reason: str) -> None:
        if key in self._refused:
            return
        if len(self._refused) > 10000:
            self._refused.clear()
        self._refused.add(key)
        log.warning("refused: %s", reason)
        self._emit({"event": "cgroup-refused", "reason": reason})

    def targets(self) -> dict[tuple[str, str], Target]:
        targets, refusals = compute_targets(self.state, self.layout, self.policy, self.page_size, self.reserved,
                                            self.fs.validate, kubelet_owns=self.kubelet_scopes,
                                            capacity=self.capacity, allocatable=self.allocatable)
        for key, why in refusals:
            self._refuse(key, why)
        return targets

    def _kubelet_path(self, path: str) -> bool:
        """Whether a cgroup path is in a scope the kubelet owns (then the shim never zeroes it)."""
        lay = self.layout
        if lay is None:
            return True
        if path == lay.kubepods:
            return "kubepods" in self.kubelet_scopes
        if path in (lay.qos(QoSClass.BURSTABLE), lay.qos(QoSClass.BESTEFFORT)):
            return "qos" in self.kubelet_scopes
        if any(path == r.path for r in self.reserved):
            return "reserved" in self.kubelet_scopes
        return "pod" in self.kubelet_scopes

    def _look(self, t: Target):
        """What t's file holds: bytes (-1 unreadable), None (no such cgroup or file), or _REFUSED."""
        try:
            text = self.fs.read(t.path, t.file)
        except PathRefused as e:
            self._refuse(f"path/{t.path}", f"{t.why}: {e}")
            return _REFUSED
        if text is None:
            return None
        try:
            return parse_value(text)
        except ValueError:
            return -1

    def _reconcile(self, reason: str, full: bool) -> int:
        """Bring every managed file to its target, keeping protection in force
        (shim.decision.protection). Returns the number of writes."""
        if not self.recovered or not self._check_tree():
            return 0
        targets = self.targets()
        for key, level in self.written.items():
            if key not in targets and not (self.kubelet_scopes and self._kubelet_path(key[0])):
                targets[key] = Target(key[0], key[1], 0, level, "no longer managed: the pod is gone",
                                      pod=self.pod_files.get(key, ""))
        # the values in force: what the shim last wrote or saw, else what the file holds now
        looked: dict = {}
        in_force: dict[tuple[str, str], int] = {}
        for key, t in targets.items():
            if full or key not in self.known:
                looked[key] = self._look(t)
            if key in self.known:
                in_force[key] = self.known[key]
            elif isinstance(looked[key], int) and looked[key] >= 0:
                in_force[key] = looked[key]
        departures = self.state.take_departures()
        targets = keep_protection(targets, in_force, departures, allocatable_bound(self.allocatable, self.capacity)[0],
                                  self.page_size,
                                  start=not self.kept and (self.client is not None or self.listings > 0))
        self.kept = True
        self.pod_files = {k: t.pod for k, t in targets.items() if t.pod}
        if full:  # forget cgroups no longer managed (pods long gone)
            self.known = {k: v for k, v in self.known.items() if k in targets}
        plan = []
        for key, t in targets.items():
            if key in looked:
                current = looked[key]
            elif self.known.get(key) == t.value:
                continue
            else:
                current = self._look(t)
            if current is _REFUSED:
                continue
            if current is None:  # the cgroup does not exist (yet, or any more)
                self.known.pop(key, None)
                if t.level == POD and t.value == 0:
                    self.written.pop(key, None)
                continue
            if current == t.value:
                self.known[key] = t.value
                continue
            up = t.value > current
            drift = key in self.known and self.known[key] == t.value
            plan.append((t, up, drift))
        ups = sorted((p for p in plan if p[1]), key=lambda p: (p[0].level, p[0].path, p[0].file))
        downs = sorted((p for p in plan if not p[1]), key=lambda p: (-p[0].level, p[0].path, p[0].file))
        writes, failed = 0, False
        for t, up, drift in ups + downs:
            key = (t.path, t.file)
            why = t.why
            if drift:
                why += f"; drift repaired: someone changed it after the shim set {t.value}"
            extra = {"trigger": reason, **({"held": t.held} if t.held else {}),
                     **({"departure": t.departure} if t.departure and not up else {})}
            try:
                w = self.fs.write(t.path, t.file, t.value, why, level=t.level, drift=drift, extra=extra)
            except PathRefused as e:
                self._refuse(f"path/{t.path}", f"{t.why}: {e}")
                continue
            except FileNotFoundError:
                self.known.pop(key, None)
                continue
            except OSError as e:
                self._error(f"write/{t.path}/{t.file}", f"writing {t.value} to {t.path}/{t.file}: {e}")
                failed = True
                continue
            writes += w is not None
            self.known[key] = t.value
            if t.value:
                self.written[key] = t.level
            else:
                self.written.pop(key, None)
        if failed:  # a value that should have gone down may still be up: keep its departures
            self.state.restore_departures(departures)
        return writes


def build_reconciler(cfg, kubelet: KubeletFacts, node, emit: Callable[[dict], None],
                     ownership=None, rollout=None) -> Reconciler | None:
    """The reconciler `serve` runs (None with --reconcile false). Its runtime client talks to
    the upstream directly, not through the proxy."""
    if not cfg.reconcile:
        return None
    from shim.node.runtime_client import RuntimeClient

    return Reconciler(
        cgroup_root=cfg.cgroup_root,
        kubelet=kubelet,
        policy=cfg.policy,
        capacity=node.capacity,
        page_size=node.page_size,
        emit=emit,
        client_factory=lambda: RuntimeClient(cfg.upstream),
        resync_interval=cfg.resync_interval,
        ownership=ownership,
        systemd_writes=cfg.systemd_writes,
        allocatable=node.allocatable,
        rollout=rollout,
    )
