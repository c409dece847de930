"""The container's memory.* values where the runtime does not carry them to the kernel.

``UpdateFollower`` (an observer of the proxy's calls; its work runs on the call-finisher's
thread, after the kubelet has its answer): it learns the runtime from the Version answers that
pass through the proxy (the kubelet asks at start and with every node status), and after an
``UpdateContainerResources`` the runtime answered OK, on a runtime that leaves ``unified`` out
of updates (CRI-O before 1.36: shim.decision.runtime, docs/nri-mode.md "What the runtimes do
with unified"), it makes the container's cgroup hold what the decision forwarded for the keys
the shim owns: memory.min / memory.low / memory.high, each written only when the file holds
something else, through the same validated walk as every container write (inside kubepods, no
symlink: shim.effects.container). Audited as ``update-write``. Fail open: a write that fails
(the cgroup gone, a refused path, the kernel's error) is audited as ``update-write-error`` and
counted; the call was answered before, nothing waits for it.

``KernelCheck`` (the monitor's, each round): a container whose cgroup holds other values than
its last decision the runtime answered OK for (``KnownContainer.unified``) is reported once per
difference (``kernel-mismatch``, and ``kernel-mismatch-cleared`` when it holds them again).
memory.high is not compared while the guard has the container relaxed or restored.
"""
from __future__ import annotations

import logging
from typing import Callable, Mapping

from shim.cri.facts import version_runtime
from shim.cri.methods import UPDATE_CONTAINER_RESOURCES, VERSION
from shim.decision.memory import kernel_values
from shim.decision.runtime import Runtime
from shim.effects.cgroupfs import PathRefused
from shim.effects.container import ContainerCgroups
from shim.effects.layout import CgroupLayout
from shim.effects.rollout import OBSERVE
from shim.guard.locate import container_dir, node_layout
from shim.guard.sampling import parse_memory_value
from shim.node.facts import KubeletFacts
from shim.node.view import ContainerRef
from shim.transport.hooks import RpcCall

log = logging.getLogger(__name__)


def _error_text(e: BaseException) -> str:
    return f"{e.__class__.__name__}: {e}"[:500]


class UpdateFollower:
    """The proxy's observer that writes a container's memory.* values after an update the
    runtime did not carry to the kernel. ``container_qos``: the rewriter (its memory of
    containers locates a container's cgroup and says which keys the kubelet owns);
    ``reconciler``: its node view locates containers the rewriter did not see created."""

    def __init__(self, *, cgroup_root: str, kubelet: KubeletFacts, emit: Callable[[dict], None],
                 container_qos, page_size: int, reconciler=None, rollout=None):
        self.cgroup_root = cgroup_root
        self.kubelet = kubelet
        self._emit = emit
        self.container_qos = container_qos
        self.reconciler = reconciler
        self.page_size = page_size
        self.fs = ContainerCgroups(cgroup_root, rollout=rollout)
        self.layout: CgroupLayout | None = None
        self.runtime = Runtime()  # not known until a Version answer passes
        self.followed = 0  # updates followed by a check of the container's cgroup
        self.written = 0  # files written
        self.errors = 0  # updates whose values could not be written

    # -- the observer (call-finisher's thread)
    def wants(self, call: RpcCall) -> bool:
        method = call.method
        return call.code == "OK" and (
            method == VERSION or (method == UPDATE_CONTAINER_RESOURCES and call.rewritten is not None
                                  and call.rewritten.decision is not None))

    def finished(self, call: RpcCall) -> None:
        if not self.wants(call):
            return
        if call.method == VERSION:
            if call.responses:
                self.runtime_seen(version_runtime(call.responses[0]))
            return
        if self.runtime.applies_unified_on_update():
            return
        note = call.rewritten
        if note.parsed is None:
            return
        cid = note.parsed.container_id
        known = self.container_qos.containers.get(cid)
        if known is not None and known.limit > 0 and note.parsed.linux.memory_limit_in_bytes <= 0:
            return  # no limit in the update (a cpuset-only one): the runtime kept the limit and its values
        self.follow(cid, kernel_values(note.decision, self.container_qos.kubelet_keys))

    def runtime_seen(self, runtime: Runtime | None) -> None:
        """A Version answer named the runtime: audited when it is a new one."""
        if runtime is None or runtime == self.runtime:
            return
        self.runtime = runtime
        applies = runtime.applies_unified_on_update()
        self._emit({"event": "runtime", "runtime": runtime.name, "runtime_version": runtime.version,
                    "unified_on_update": "applied by the runtime" if applies else "written by the shim",
                    **({} if applies else {"why": runtime.why_update_drops()})})
        if applies:
            log.info("runtime %s applies unified on UpdateContainerResources", runtime.label())
        else:
            log.warning("%s; after each update the shim writes the container's memory.* values itself",
                        runtime.why_update_drops())

    # -- the write
    def locate(self, cid: str) -> ContainerRef | None:
        known = self.container_qos.containers.get(cid)
        if known is not None:
            pod = known.pod
            return ContainerRef(cid, pod.namespace, pod.name, known.name, pod.uid, pod.cgroup_parent,
                                getattr(known.qos, "value", str(known.qos)))
        view = getattr(self.reconciler, "view", None)
        for ref in getattr(view, "containers", ()):
            if ref.id == cid:
                return ref
        return None

    def follow(self, cid: str, values: Mapping[str, str]) -> dict | None:
        """Make container ``cid``'s cgroup hold ``values`` (file -> value); the audit record, or
        None when there was nothing to do."""
        if not cid or not values:
            return None
        self.followed += 1
        observe = self.fs.rollout.observe
        record = {"event": "update-write", "container_id": cid[:128], "runtime": self.runtime.label(),
                  "why": self.runtime.why_update_drops()}
        if observe:
            record["rollout"] = OBSERVE
        ref = self.locate(cid)
        if ref is not None:
            record.update(pod=f"{ref.namespace}/{ref.pod}", pod_uid=ref.uid, container=ref.container)
        try:
            if ref is None:
                raise LookupError("container not known: neither created through the shim nor in the node state")
            layout, why = node_layout(self.cgroup_root, self.kubelet, self.layout)
            if layout is None:
                raise LookupError(why)
            if layout is not self.layout:
                self.layout = layout
                self.fs.set_allowed([layout.kubepods])
            rel = container_dir(self.fs, layout, ref)
            if rel is None:
                raise FileNotFoundError(f"no cgroup directory for container {cid[:12]} under its pod")
            record["path"] = self.fs.abspath(rel)
            done = self.fs.settle(rel, dict(values), self.page_size, observe=observe)
        except (OSError, ValueError, LookupError, PathRefused) as e:
            self.errors += 1
            record.update(event="update-write-error", wanted=dict(values), error=_error_text(e))
            log.warning("could not write the memory.* values of container %s after its update: %s", cid[:12],
                        record["error"])
            self._emit(record)
            return record
        record["written"] = {f: {"old": old, "new": new} for f, (old, new) in done.items() if new is not None}
        record["unchanged"] = {f: old for f, (old, new) in done.items() if new is None}
        if not observe:
            self.written += len(record["written"])
        if record["written"]:
            log.info("container %s after its update: %s", cid[:12],
                     ", ".join(f"{f} {w['old']} -> {w['new']}" for f, w in record["written"].items()))
        self._emit(record)
        return record


class KernelCheck:
    """The monitor's comparison of each container's cgroup with its decision (see the module's
    doc). ``expected(container id)``: the values its cgroup is to hold, or None."""

    def __init__(self, expected: Callable[[str], Mapping[str, str] | None], emit: Callable[[dict], None],
                 page_size: int):
        self.expected = expected
        self._emit = emit
        self.page_size = page_size
        self._reported: dict[str, tuple] = {}  # container id -> the differences last reported

    @property
    def mismatched(self) -> int:
        """Containers whose cgroup holds other values than their decision, as last seen."""
        return len(self._reported)

    def differences(self, want: Mapping[str, str], files: Mapping[str, str | None], *,
                    skip_high: bool = False) -> dict[str, dict]:
        out = {}
        for key, value in want.items():
            if key == "memory.high" and skip_high:
                continue
            have = parse_memory_value(files.get(key))
            if have == "?":  # missing or unreadable: nothing to compare
                continue
            expect = None if value == "max" else int(value) // self.page_size * self.page_size
            if have != expect:
                out[key] = {"decided": value, "kernel": "max" if have is None else str(have)}
        return out

    def check(self, ref: ContainerRef, path: str, files: Mapping[str, str | None], *,
              skip_high: bool = False) -> None:
        want = self.expected(ref.id)
        if not want:
            return
        diffs = self.differences(want, files, skip_high=skip_high)
        key = tuple(sorted((k, d["decided"], d["kernel"]) for k, d in diffs.items()))
        if key == self._reported.get(ref.id, ()):
            return
        base = {"container_id": ref.id, "pod": f"{ref.namespace}/{ref.pod}", "pod_uid": ref.uid,
                "container": ref.container, "path": path}
        if diffs:
            self._reported[ref.id] = key
            self._emit({"event": "kernel-mismatch", **base, "differences": diffs})
            log.warning("container %s (%s): its cgroup holds other values than the shim decided: %s", ref.label(),
                        ref.id[:12], ", ".join(f"{k} {d['kernel']} (decided {d['decided']})" for k, d in diffs.items()))
        else:
            self._reported.pop(ref.id, None)
            self._emit({"event": "kernel-mismatch-cleared", **base})
            log.info("container %s (%s): its cgroup holds the decided values again", ref.label(), ref.id[:12])

    def forget(self, alive: set[str]) -> None:
        for cid in [c for c in self._reported if c not in alive]:
            self._reported.pop(cid, None)
