"""What the kubelet itself writes for Memory QoS, by kubelet version and KubeletConfiguration,
and who -- the kubelet or the shim -- owns each value on this node.

Pure functions over facts (no I/O) except ``detect_kubelet_version``, which runs
``kubelet --version`` once at start-up (never on the CRI path).

Kubelet behaviour by version (KEP-2570 "Memory QoS", kubernetes/enhancements
keps/sig-node/2570-memory-qos; the kubelet's pkg/kubelet/kuberuntime and pkg/kubelet/cm;
the v1.36 and v1.37 Memory QoS blog posts):

* v1.22-v1.26, gate ``MemoryQoS`` alpha (off by default): with the gate on, container
  memory.min = request and memory.high = limit (or allocatable) x factor (default 0.8); pod
  memory.min = the pod's request; kubepods and the burstable QoS cgroup memory.min = the sums;
  reserved cgroups memory.min = the reservation when enforced.
* v1.27-v1.35: the same, memory.high by floor(req + (L - req) x factor) to a page, factor
  default 0.9, no memory.high for Guaranteed pods.
* v1.36 (alpha v3, gate still off by default): ``memoryReservationPolicy`` ``None`` (default:
  no memory.min / memory.low; the container's unified carries memory.min="0", memory.low="0")
  or ``TieredReservation`` (Guaranteed: memory.min, Burstable: memory.low, at container and pod
  level; kubepods memory.min = Guaranteed + Burstable sums, burstable QoS cgroup memory.low =
  Burstable sum). memoryThrottlingFactor still defaults to 0.9.
* v1.37 (beta): the gate is on by default and memoryThrottlingFactor defaults to unset (no
  memory.high); with the gate off on cgroup v2 the kubelet sends memory.high="max" to clear an
  earlier value. A default v1.37 kubelet writes no memory.min / memory.low / memory.high.
* v1.38 (proposed, kubernetes/enhancements#6362): ``Hard`` (memory.min for all) and ``Soft``
  (memory.low for all) join the enum.

Where a behaviour is not recorded upstream and the model assumes it, the text says "assumed,
not recorded". Which keys the kubelet writes for one container (its QoS class, request and
limit) is ``shim.decision.kubelet``'s rule: ``KubeletWrites.rule`` hands it this kubelet, and
``Ownership.container_keys`` the keys both front ends' decision resolves per container.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

from shim.decision import Policy, QoSClass, Request, RequestSource
from shim.decision.kubelet import REQUEST, V122, V127, V137, KubeletKeys, KubeletRule, kubelet_writes_keys

# The kubelet's own memoryReservationPolicy values (v1.36: None, TieredReservation; v1.38
# proposal: Hard, Soft). The same names as the shim's policies.
KUBELET_POLICIES = {p.value: p for p in (Policy.NONE, Policy.TIERED_RESERVATION, Policy.HARD, Policy.SOFT)}

KUBELET = "kubelet"
SHIM = "shim"

_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: str | None) -> tuple[int, int] | None:
    """'v1.37.2', '1.37', 'Kubernetes v1.37.0-rc.1' -> (1, 37); anything else -> None."""
    if not text:
        return None
    m = _VERSION.search(str(text))
    if not m:
        return None
    return int(m.group(1)), int(m.group(2))


def fmt_version(v: tuple[int, int] | None) -> str:
    return "unknown" if v is None else f"{v[0]}.{v[1]}"


# -- finding the kubelet's version (start-up only) -----------------------------------------
KUBELET_PATHS = ("/usr/bin/kubelet", "/usr/local/bin/kubelet", "/opt/bin/kubelet")


def _running_kubelet_exe(proc_root: str) -> str | None:
    try:
        entries = os.listdir(proc_root)
    except OSError:
        return None
    for pid in entries:
        if not pid.isdigit():
            continue
        try:
            with open(os.path.join(proc_root, pid, "comm"), encoding="utf-8", errors="replace") as f:
                if f.read().strip() != "kubelet":
                    continue
            return os.readlink(os.path.join(proc_root, pid, "exe"))
        except OSError:
            continue
    return None


def detect_kubelet_version(setting: str = "auto", *, proc_root: str = "/proc", timeout: float = 3.0,
                           candidates: tuple[str, ...] | None = None) -> tuple[tuple[int, int] | None, str]:
    """(version, how it was found). ``setting``: a version ('1.37', 'v1.37.2'), 'unknown', or
    'auto': ``<kubelet> --version`` of the running kubelet's executable, else the first
    ``kubelet`` on PATH or in the usual places. Run once at start-up, before serving (the shim
    usually starts before the kubelet, so the binary, not the process, is the common source).
    Never raises: an unknown version is reported with the reason."""
    text = (setting or "auto").strip()
    if text.lower() in ("unknown", "none", ""):
        return None, "--kubelet-version unknown"
    if text.lower() != "auto":
        v = parse_version(text)
        return (v, f"--kubelet-version {text}") if v else (None, f"--kubelet-version {text!r} is not a version")
    exes: list[str] = []
    running = _running_kubelet_exe(proc_root)
    if running:
        exes.append(running)
    if candidates is None:
        found = shutil.which("kubelet")
        candidates = ((found,) if found else ()) + KUBELET_PATHS
    exes += [c for c in candidates if c and c not in exes]
    tried = []
    for exe in exes:
        if not os.path.isfile(exe) or not os.access(exe, os.X_OK):
            continue
        try:
            out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.SubprocessError) as e:
            tried.append(f"{exe}: {e.__class__.__name__}")
            continue
        v = parse_version(out.stdout) if out.returncode == 0 else None
        if v is not None:
            return v, f"{exe} --version: {out.stdout.strip()[:60]}"
        tried.append(f"{exe}: no version in its output")
    return None, ("no kubelet executable found" if not tried else "; ".join(tried)) + \
        " (--kubelet-version auto); set --kubelet-version"


# -- what the kubelet writes ------------------------------------------------------------------
@dataclass(frozen=True)
class KubeletWrites:
    """What this node's kubelet writes for Memory QoS itself."""

    version: tuple[int, int] | None
    gate: bool  # the MemoryQoS gate as the kubelet runs with it (explicit, default, or assumed)
    gate_reason: str
    policy_aware: bool  # v1.36+: memoryReservationPolicy exists; before, the gate meant memory.min
    protection: Policy | None  # how the kubelet protects requests; None: it writes no memory.min/low
    factor: float | None  # the factor the kubelet's memory.high uses; None: it sets no memory.high
    formula: str  # "v1.22" (limit x factor) or "v1.27" (req + (limit - req) x factor)
    assumptions: tuple[str, ...] = field(default_factory=tuple)

    @property
    def writes_protection(self) -> bool:
        return self.gate and self.protection is not None

    @property
    def writes_high(self) -> bool:
        return self.gate and self.factor is not None

    @property
    def high_formulas(self) -> tuple[str, ...]:
        """The memory.high formula(s) the kubelet may use (shim.decision.kubelet): one for a known
        version; an unknown one takes each its configuration allows."""
        v = self.version
        if v is not None:
            return (V122,) if v < (1, 27) else (V127,) if v < (1, 37) else (V137,)
        return (V127, V137) if self.policy_aware else (V122, V127)

    def rule(self) -> KubeletRule:
        """What this kubelet writes into a container's unified, as ``shim.decision.kubelet``
        applies it to each container (its QoS class, request and limit)."""
        if not self.policy_aware:
            protection = REQUEST if self.gate else None
        else:
            protection = self.protection.value if self.protection is not None else None
        return KubeletRule(gate=self.gate, protection=protection, factor=self.factor if self.gate else None,
                           formulas=self.high_formulas, version=fmt_version(self.version))

    def summary(self) -> str:
        if not self.gate:
            what = "writes no memory.min/memory.low/memory.high"
        else:
            parts = [f"protection {self.protection.value}" if self.protection else "no memory.min/memory.low",
                     f"memory.high with factor {self.factor} ({self.formula} formula)" if self.factor is not None
                     else "no memory.high"]
            what = "writes " + ", ".join(parts)
        return f"kubelet {fmt_version(self.version)}, MemoryQoS gate {'on' if self.gate else 'off'} " \
               f"({self.gate_reason}): {what}"


def kubelet_writes(kubelet, version: tuple[int, int] | None) -> KubeletWrites:
    """The kubelet's own Memory QoS writes from its configuration (shim.node.facts.KubeletFacts) and
    version. An unknown version takes the conservative reading: whatever the configuration
    asks for explicitly is assumed to be written (the shim then stands aside), and the text
    says so."""
    assumptions: list[str] = []
    policy_name = getattr(kubelet, "memory_reservation_policy", None)
    policy = KUBELET_POLICIES.get(policy_name) if policy_name else None
    factor_set = kubelet.memory_throttling_factor
    explicit = kubelet.memory_qos_gate
    asks = (policy is not None and policy is not Policy.NONE) or factor_set is not None

    if version is not None:
        policy_aware = version >= (1, 36)
    elif policy_name is not None:
        policy_aware = True
        assumptions.append("version unknown: memoryReservationPolicy is set, so a v1.36+ kubelet is assumed "
                           "(the field does not exist before v1.36)")
    elif explicit is None and asks:
        policy_aware = True
        assumptions.append("version unknown: assumed v1.37+ (MemoryQoS on by default), the conservative case "
                           "for the values the configuration asks for")
    else:
        policy_aware = False
        if explicit:
            assumptions.append("version unknown: with featureGates.MemoryQoS on and no memoryReservationPolicy, "
                               "a v1.22-v1.35 kubelet is assumed (memory.min = request everywhere)")

    if explicit is not None:
        gate, gate_reason = explicit, f"featureGates.MemoryQoS: {str(explicit).lower()}"
    elif version is not None:
        gate = version >= (1, 37)
        gate_reason = "default: beta, on from v1.37" if gate else "default: alpha, off before v1.37"
    elif asks:
        gate, gate_reason = True, "not set, version unknown: assumed on (v1.37+ default)"
    else:
        gate, gate_reason = False, "not set, version unknown: off before v1.37, and a v1.37+ kubelet with " \
                                   "this configuration writes nothing either"

    formula = "v1.22" if version is not None and version < (1, 27) else "v1.27"

    if not policy_aware:
        protection = Policy.HARD  # before v1.36 the gate meant memory.min = request, pod / QoS / node too
        if factor_set is not None:
            factor = factor_set
        else:
            factor = 0.8 if version is not None and version < (1, 27) else 0.9
    else:
        protection = policy if policy is not None and policy is not Policy.NONE else None
        if policy is Policy.HARD or policy is Policy.SOFT:
            if version is not None and version < (1, 38):
                assumptions.append(f"memoryReservationPolicy {policy.value} is a v1.38 proposal; a kubelet "
                                   f"{fmt_version(version)} would reject it")
            assumptions.append(f"{policy.value} at QoS and kubepods level: the same sums as the shim's "
                               f"{policy.value} (assumed, not recorded)")
        if factor_set is not None:
            factor = factor_set
        elif version is not None and version >= (1, 37) or (version is None and explicit is None):
            factor = None  # v1.37: memoryThrottlingFactor defaults to unset
        elif version is not None:
            factor = 0.9  # v1.36 default
        else:
            factor = 0.9  # unknown version, gate explicitly on, policy field set: v1.36 default assumed
            assumptions.append("version unknown: memoryThrottlingFactor unset and the gate on; the v1.36 "
                               "default 0.9 is assumed (a v1.37+ kubelet would set no memory.high)")
    return KubeletWrites(version=version, gate=gate, gate_reason=gate_reason, policy_aware=policy_aware,
                         protection=protection if gate else None, factor=factor if gate else None,
                         formula=formula, assumptions=tuple(assumptions))


_GI = 1 << 30
# one container of each kind (label, QoS class, request, limit): the cases the kubelet tells apart
KINDS = (("Guaranteed", QoSClass.GUARANTEED, _GI, _GI),
         ("Burstable request < limit", QoSClass.BURSTABLE, _GI // 4, _GI),
         ("Burstable without a limit", QoSClass.BURSTABLE, _GI // 4, 0),
         ("Burstable request = limit", QoSClass.BURSTABLE, _GI, _GI),
         ("BestEffort", QoSClass.BESTEFFORT, 0, 0))


def keys_by_kind(writes: KubeletWrites, allocatable: int = 64 * _GI, page_size: int = 4096) -> str:
    """Which container keys this kubelet writes a value into, for each kind of container
    (``KINDS``), as ``shim.decision.kubelet`` decides it for every container: one line."""
    rule = writes.rule()
    parts = []
    for label, qos, request, limit in KINDS:
        keys = kubelet_writes_keys(rule, qos, Request(request, RequestSource.GIVEN), limit, allocatable, page_size,
                                   together=False)
        parts.append(f"{label}: {', '.join(sorted(keys)) or 'none'}")
    return "; ".join(parts)


# -- who owns what ----------------------------------------------------------------------------
CONTAINER_PROTECTION = "container memory.min/memory.low"
CONTAINER_HIGH = "container memory.high"
POD, QOS, KUBEPODS, RESERVED = "pod", "qos", "kubepods", "reserved"
LABELS = {
    CONTAINER_PROTECTION: "container memory.min / memory.low",
    CONTAINER_HIGH: "container memory.high",
    POD: "pod memory.min / memory.low",
    QOS: "QoS cgroups (burstable, besteffort)",
    KUBEPODS: "kubepods",
    RESERVED: "kube-reserved / system-reserved",
}


@dataclass(frozen=True)
class Ownership:
    """Who writes each value on this node: ``kubelet`` or ``shim``, and why.

    The rule: a value the kubelet is configured to write (a v1.36+ kubelet with the gate on and
    a memoryReservationPolicy other than None, or a memoryThrottlingFactor) is the kubelet's: the
    shim forwards the kubelet's unified keys unchanged and does not write those pod / QoS / node
    files. Before v1.36 a kubelet with the gate on writes memory.min = request everywhere, the
    pod's at sandbox creation: the shim stands aside at pod / QoS / node level with every policy
    (the shim learns a pod's request container by container, so its own value would trail the
    kubelet's while a pod starts); container keys stay the shim's (its proxy is the last writer
    of unified, the kubelet never writes container cgroups itself, and the shim replaces the
    v1.22 formula)."""

    owners: dict[str, str]
    reasons: dict[str, str]
    writes: KubeletWrites
    # the container keys as both front ends' decision takes them, resolved per container
    # (shim.decision.kubelet.KubeletKeys); None: those of ``kubelet_keys`` in every container
    container: KubeletKeys | None = None

    def owner(self, what: str) -> str:
        return self.owners[what]

    def container_keys(self) -> KubeletKeys:
        """The container keys the kubelet owns, for ``shim.decision.decide`` (rewriter and NRI
        handler): as a mapping the keys it owns in every container; per container (its QoS
        class, request and limit) in NRI mode, where the kubelet's own values are not seen."""
        return self.container if self.container is not None else KubeletKeys(self.kubelet_keys())

    def kubelet_keys(self) -> dict[str, str]:
        """unified keys the shim must forward unchanged -> why."""
        out = {}
        if self.owners[CONTAINER_PROTECTION] == KUBELET:
            out["memory.min"] = out["memory.low"] = self.reasons[CONTAINER_PROTECTION]
        if self.owners[CONTAINER_HIGH] == KUBELET:
            out["memory.high"] = self.reasons[CONTAINER_HIGH]
        return out

    def owned_by_kind(self, allocatable: int = 64 * _GI, page_size: int = 4096) -> str:
        """The container keys the kubelet owns in each kind of container (``KINDS``), as the
        decision resolves them for a container (``container_keys``): one line."""
        keys = self.container_keys()
        parts = []
        for label, qos, request, limit in KINDS:
            owned = keys.for_container(qos, Request(request, RequestSource.GIVEN), limit, allocatable, page_size, {})
            parts.append(f"{label}: {', '.join(sorted(owned)) or 'none'}")
        return "; ".join(parts)

    def kubelet_scopes(self) -> frozenset[str]:
        """Reconciler scopes (pod, qos, kubepods, reserved) the shim leaves to the kubelet."""
        return frozenset(s for s in (POD, QOS, KUBEPODS, RESERVED) if self.owners[s] == KUBELET)

    def lines(self) -> list[str]:
        return [f"{LABELS[k]:38} {self.owners[k]:8} {self.reasons[k]}" for k in LABELS]

    def summary_lines(self) -> list[str]:
        """One line per owner and reason: 'shim: pod ..., kubepods (why)' -- the values one
        reason decides are named together, the reason said once."""
        groups: dict[tuple[str, str], list[str]] = {}
        for k in LABELS:
            groups.setdefault((self.owners[k], self.reasons[k]), []).append(LABELS[k])
        return [f"{who}: {', '.join(whats)} ({why})" for (who, why), whats in groups.items()]

    def as_dict(self) -> dict:
        return {k: {"owner": self.owners[k], "why": self.reasons[k]} for k in LABELS}


NRI_KEEPS = ("NRI mode: where the kubelet writes this key for a container (by its version, the container's QoS "
             "class, request and limit), the runtime's NRI may not show its value (containerd < 2.2 hands plugins "
             "an empty unified map), so the plugin leaves it to the kubelet; in the other containers the shim "
             "sets it as in proxy mode")
NRI_HIDDEN = "NRI mode: the kubelet's value is not shown to the plugin (containerd < 2.2), so it is left to the kubelet"


def ownership(writes: KubeletWrites, policy: Policy, *, nri: bool = False) -> Ownership:
    """Who owns each value. ``nri`` (NRI mode): a container key the kubelet writes for a
    container is the kubelet's in that container, whatever its version (the per-container rule
    is ``shim.decision.kubelet``: the kubelet's version, gate and policy, the container's QoS
    class, request and limit). A plugin cannot reuse the kubelet's request exactly as the proxy
    does (on containerd < 2.2 it never sees it), so an estimate of its own would replace -- and
    could lower -- the kubelet's value; those keys are left out of that container's adjustment.
    In a container where the kubelet writes no value for a key, the plugin decides it as proxy
    mode does."""
    owned = _ownership(writes, policy)
    if not nri:
        return owned
    owners, reasons = dict(owned.owners), dict(owned.reasons)
    for what, writes_it in ((CONTAINER_PROTECTION, writes.writes_protection), (CONTAINER_HIGH, writes.writes_high)):
        if writes_it and owners[what] != KUBELET:
            owners[what], reasons[what] = KUBELET, f"{NRI_KEEPS} ({writes.summary()})"
    hidden = writes.rule() if writes.writes_protection or writes.writes_high else None
    return Ownership(owners, reasons, writes, KubeletKeys(owned.kubelet_keys(), hidden, NRI_HIDDEN))


def _ownership(writes: KubeletWrites, policy: Policy) -> Ownership:
    owners: dict[str, str] = {}
    reasons: dict[str, str] = {}

    def put(what: str, who: str, why: str) -> None:
        owners[what], reasons[what] = who, why

    shim_says = f"shim policy {policy.value}"
    if not writes.gate:
        why = f"the kubelet's MemoryQoS gate is off ({writes.gate_reason}): {shim_says}"
        for what in LABELS:
            put(what, SHIM, why)
        return Ownership(owners, reasons, writes)
    if writes.policy_aware:
        if writes.protection is not None:
            why = f"kubelet memoryReservationPolicy {writes.protection.value}: the kubelet's values are kept"
            for what in (CONTAINER_PROTECTION, POD, QOS, KUBEPODS):
                put(what, KUBELET, why)
            put(RESERVED, KUBELET, why + " (memory.min = the reservation when enforced)")
        else:
            why = f"kubelet memoryReservationPolicy None: it writes no memory.min/memory.low; {shim_says}"
            for what in (CONTAINER_PROTECTION, POD, QOS, KUBEPODS):
                put(what, SHIM, why)
            put(RESERVED, SHIM, why + " (assumed, not recorded: a kubelet with None leaves the reserved "
                                      "cgroups' memory.min alone)")
        if writes.factor is not None:
            put(CONTAINER_HIGH, KUBELET, f"kubelet memoryThrottlingFactor {writes.factor}: its memory.high is kept")
        else:
            put(CONTAINER_HIGH, SHIM, "the kubelet sets no memory.high (memoryThrottlingFactor unset, v1.37+)")
        return Ownership(owners, reasons, writes)
    # a v1.22-v1.35 kubelet with the gate on: memory.min = request everywhere, memory.high
    put(CONTAINER_PROTECTION, SHIM, "kubelet before v1.36 with the gate on: the shim's proxy is the last writer "
                                    "of unified; the request the kubelet sends is reused exactly")
    put(CONTAINER_HIGH, SHIM, f"kubelet before v1.36 with the gate on ({writes.formula} formula): the shim's "
                              "value replaces it in unified")
    for what in (POD, QOS, KUBEPODS, RESERVED):
        value = "the reservation" if what == RESERVED else "the request sums"
        put(what, KUBELET, f"kubelet before v1.36 with the gate on writes memory.min = {value} here itself (a pod's "
                           "at sandbox creation, before any container exists): the shim stands aside, whatever its "
                           "policy, so it never writes a value of its own over the kubelet's")
    return Ownership(owners, reasons, writes)
