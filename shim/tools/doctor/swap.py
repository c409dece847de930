"""Swap: is there swap on the node, does the kernel account it per cgroup, and what does the
kubelet write into a container's ``memory.swap.max`` (CRI ``unified``) by version, swap
behaviour and QoS class.

What the kubelet does, read in its source (pkg/kubelet/kuberuntime/kuberuntime_container_linux.go)
and KEP-2400 (kubernetes/enhancements keps/sig-node/2400-node-swap, "Implementation History");
docs/memory-qos.md section 8 ("Swap") has the table:

* before v1.22: no swap support; with swap on the kubelet refuses to start unless
  ``failSwapOn: false``, and sends nothing about swap (the runtime's default: no limit).
* v1.22-v1.27 (gate ``NodeSwap``, alpha, off by default): only with the gate on, and never in
  ``unified``: ``memory_swap_limit_in_bytes`` (memory + swap) = the memory limit for
  ``LimitedSwap`` or an empty behaviour (no swap beyond the limit), -1 for ``UnlimitedSwap``.
  Gate off: nothing.
* v1.28-v1.29 (beta 1, gate off by default; kubernetes#118764, #120784): where the kubelet's
  own cgroup has ``memory.swap.max``, ``unified`` ``memory.swap.max``: ``0`` for every container
  with the gate off; with it on, ``LimitedSwap`` gives Burstable containers request / MemTotal x
  swap size and the others 0, ``UnlimitedSwap`` (the default then) gives ``max``.
* v1.30 and later (beta 2, gate on by default; ``NoSwap`` the default behaviour and
  ``UnlimitedSwap`` gone, kubernetes#122745): whenever the kubelet's own cgroup has a
  ``memory.swap.max`` file, every container's ``unified`` carries ``memory.swap.max``: under
  ``LimitedSwap`` a Burstable container whose memory request is set and differs from its limit
  gets floor(request / MemTotal x swap size), every other container (Guaranteed, BestEffort,
  request = limit, and from v1.31 critical pods, kubernetes#125277) and every container under
  ``NoSwap`` gets ``0``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from shim.tools.doctor.common import FAIL, PASS, WARN, CheckBase, Result, read_text

NO_SWAP, LIMITED, UNLIMITED = "NoSwap", "LimitedSwap", "UnlimitedSwap"


@dataclass(frozen=True)
class KubeletSwap:
    """The KubeletConfiguration's swap fields as written (None: not in the file)."""

    fail_swap_on: bool | None = None
    behavior: str | None = None  # memorySwap.swapBehavior
    gate: bool | None = None  # featureGates.NodeSwap
    problems: tuple[str, ...] = ()


def kubelet_swap_config(doc) -> KubeletSwap:
    """The swap fields of a parsed KubeletConfiguration (any shape: a wrong one is a problem)."""
    if not isinstance(doc, dict):
        return KubeletSwap()
    problems = []
    fail = doc.get("failSwapOn")
    if fail is not None and not isinstance(fail, bool):
        problems.append(f"failSwapOn {fail!r} is not a boolean")
        fail = None
    behavior = None
    mem = doc.get("memorySwap")
    if isinstance(mem, dict):
        b = mem.get("swapBehavior")
        if b not in (None, ""):
            if b in (NO_SWAP, LIMITED, UNLIMITED):
                behavior = b
            else:
                problems.append(f"memorySwap.swapBehavior {str(b)[:40]!r} is not NoSwap or LimitedSwap")
    elif mem is not None:
        problems.append("memorySwap is not a map")
    gates = doc.get("featureGates")
    gate = gates.get("NodeSwap") if isinstance(gates, dict) else None
    return KubeletSwap(fail, behavior, gate if isinstance(gate, bool) else None, tuple(problems))


def swap_devices(proc: str) -> list[tuple[str, int]]:
    """(device, size in bytes) of each active swap area, from /proc/swaps."""
    out = []
    for line in (read_text(os.path.join(proc, "swaps")) or "").splitlines()[1:]:
        f = line.split()
        if len(f) >= 3 and f[2].isdigit():
            out.append((f[0], int(f[2]) * 1024))
    return out


def meminfo_swap(path: str) -> int | None:
    """SwapTotal in bytes, None when the file has no SwapTotal line."""
    for line in (read_text(path) or "").splitlines():
        if line.startswith("SwapTotal:"):
            f = line.split()
            if len(f) >= 2 and f[1].isdigit():
                return int(f[1]) * 1024
    return None


def kubelet_swap_writes(version: tuple[int, int] | None, cfg: KubeletSwap, *, accounting: bool,
                        cgroup_v2: bool = True) -> tuple[str, list[str], list[str]]:
    """(summary, details, problems): what the kubelet of ``version`` sends about swap for each
    QoS class (module docstring). ``accounting``: the kernel has memory.swap.max per cgroup (the
    kubelet looks for it in its own cgroup and sends nothing about swap without it)."""
    behavior = cfg.behavior
    details: list[str] = []
    problems: list[str] = []
    assumed = version is None
    v = version or (1, 31)
    if assumed:
        details.append("kubelet version unknown: assumed v1.31 or later")
    if v < (1, 22):
        return ("no swap support before v1.22: nothing about swap in CRI (the runtime's default, no limit)",
                details, problems)
    gate_default = v >= (1, 30)
    gate = cfg.gate if cfg.gate is not None else gate_default
    gate_text = f"NodeSwap gate {'on' if gate else 'off'}" + ("" if cfg.gate is not None else " (default)")
    if v < (1, 28):
        if not gate:
            return f"{gate_text}: nothing about swap in CRI (the runtime's default: no limit)", details, problems
        if behavior == UNLIMITED:
            return f"{gate_text}, UnlimitedSwap: memory_swap_limit_in_bytes -1 (no limit)", details, problems
        return (f"{gate_text}, {behavior or 'LimitedSwap (empty)'}: memory_swap_limit_in_bytes = the memory limit "
                "(no swap beyond it; not in unified)", details, problems)
    if not cgroup_v2:
        return f"{gate_text}: cgroup v1, no memory.swap.max in unified", details, problems
    if not accounting:
        problems.append("no memory.swap.max in the kubepods cgroup: the kernel does not account swap per cgroup "
                        "(CONFIG_MEMCG_SWAP off, or swapaccount=0), so the kubelet sends nothing about swap and "
                        "a container can swap without limit")
        return f"{gate_text}: nothing about swap in CRI (no swap accounting)", details, problems
    if v < (1, 30):
        if not gate:
            return f"{gate_text}: unified memory.swap.max 0 for every container (no container swaps)", details, problems
        if behavior != LIMITED:
            return (f"{gate_text}, {behavior or UNLIMITED + ' (the default then)'}: unified memory.swap.max max for "
                    "every container", details, problems)
        details.append("Guaranteed, BestEffort, request = limit, critical pods: memory.swap.max 0")
        return (f"{gate_text}, {LIMITED}: unified memory.swap.max = request / MemTotal x swap size "
                "for Burstable containers, 0 for the others", details, problems)
    if behavior == UNLIMITED:
        problems.append("memorySwap.swapBehavior UnlimitedSwap was removed in v1.30: this kubelet does not accept it")
    if behavior == LIMITED and gate:
        details += ["Burstable, memory request set and != limit, not a critical pod: memory.swap.max = "
                    "floor(request / MemTotal x swap size)",
                    "Guaranteed, BestEffort, request = limit, critical pods: memory.swap.max 0"]
        return f"{gate_text}, LimitedSwap: unified memory.swap.max for every container", details, problems
    if behavior == LIMITED:
        problems.append("memorySwap.swapBehavior LimitedSwap with the NodeSwap gate off: the kubelet uses NoSwap")
    return (f"{gate_text}, {NO_SWAP}{'' if behavior else ' (default)'}: unified memory.swap.max 0 for every "
            "container (no container swaps)", details, problems)


class SwapChecks(CheckBase):
    """Swap on the node, and the kubelet's swap behaviour."""

    def _swap_kubelet_config(self) -> KubeletSwap:
        import yaml

        path = self.cfg.kubelet_config
        if not path:
            return KubeletSwap()
        try:
            doc = yaml.safe_load(read_text(path) or "")
        except yaml.YAMLError:
            return KubeletSwap()
        return kubelet_swap_config(doc)

    def _kubepods_swap_max(self) -> tuple[str, str | None]:
        """(the cgroup read, its memory.swap.max or None when there is none): kubepods, or before
        the kubelet made it, the first child of the root that has the file (the kernel gives every
        non-root cgroup one when it accounts swap)."""
        from shim.effects.layout import CgroupLayout

        _, driver = self._driver()
        root = self.cfg.cgroup_root
        kp = os.path.join(root, CgroupLayout(driver, self.kubelet.cgroup_root).kubepods)
        candidates = [kp]
        if not os.path.isdir(kp):
            try:
                candidates += sorted(os.path.join(root, n) for n in os.listdir(root)
                                     if os.path.isdir(os.path.join(root, n)))[:64]
            except OSError:
                pass
        for d in candidates:
            text = read_text(os.path.join(d, "memory.swap.max"), 64)
            if text is not None:
                return d, text.strip()
        return kp, None

    def _swap_classes(self) -> list[str]:
        return sorted(c.name for c in (getattr(self.cfg, "classes", None) or ()) if getattr(c, "swap", False))

    def check_swap(self) -> Result:
        from shim.decision.quantity import format_bytes

        name = "swap"
        devices = swap_devices(self.env.proc)
        total = meminfo_swap(self.cfg.meminfo)
        size = total if total is not None else sum(s for _, s in devices)
        kp, swap_max = self._kubepods_swap_max()
        where = f"{kp}/memory.swap.max " + (swap_max if swap_max is not None else "absent")
        classes = self._swap_classes()
        if not size:
            details = [where]
            if classes:
                details.append(f"classes allowing swap ({', '.join(classes)}) change nothing on this node")
            return Result(name, PASS, "no swap on this node (SwapTotal 0)", details)
        summary = (f"on: {format_bytes(size)} in {len(devices)} area(s)"
                   + (f" ({', '.join(d for d, _ in devices[:4])})" if devices else "") + f"; {where}")
        k = self._swap_kubelet_config()
        details = []
        if k.fail_swap_on is not False:
            fail_flag = None
            for args in getattr(self, "_kubelet_processes", lambda: [])():
                fail_flag = self._flag(args, "--fail-swap-on")
            if fail_flag is None or fail_flag.lower() not in ("false", "0"):
                return Result(name, FAIL, summary, [
                    f"failSwapOn is {'not set (true)' if k.fail_swap_on is None else 'true'} in "
                    f"{self.cfg.kubelet_config or 'the kubelet config'}: the kubelet refuses to start with swap on",
                    "set failSwapOn: false (and memorySwap.swapBehavior) or turn swap off"])
        if swap_max is None:
            return Result(name, WARN, summary, [
                "the kernel has no memory.swap.max per cgroup (CONFIG_MEMCG_SWAP off, or swapaccount=0): no limit "
                "holds a container's swap, and memory.high pushes anon pages out to swap unbounded"])
        if classes:
            details.append(f"classes allowing swap: {', '.join(classes)}")
        return Result(name, PASS, summary, details)

    def check_kubelet_swap(self) -> Result:
        from shim.node.facts import is_cgroup_v2

        name = "kubelet swap"
        k = self._swap_kubelet_config()
        writes, _, how = self._ownership()
        _, swap_max = self._kubepods_swap_max()
        summary, details, problems = kubelet_swap_writes(writes.version, k, accounting=swap_max is not None,
                                                         cgroup_v2=is_cgroup_v2(self.cfg.cgroup_root))
        details = [f"kubelet version: {how}"] + details + list(k.problems)
        details.append("the shim keeps what the kubelet sends in memory.swap.max: never removed, never lowered")
        classes = self._swap_classes()
        if classes and "memory.swap.max" in summary and "nothing" not in summary:
            # (a swap class adds memory.swap.max: max only where the kubelet sent none)
            problems.append(f"classes allowing swap ({', '.join(classes)}) change nothing here: this kubelet sends "
                            "memory.swap.max for their containers, which the shim keeps")
        elif classes:
            details.append(f"classes allowing swap ({', '.join(classes)}): their containers get memory.swap.max max "
                           "where the kubelet sends none")
        return Result(name, WARN if problems or k.problems else PASS, summary, problems + details)
