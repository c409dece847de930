"""Protection in force is kept: a pod's, a QoS class's or kubepods' memory.min / memory.low is
never written lower than what the file holds, except when a pod or container has left, or when
the policy protects with the other file of the pair. Pure: no I/O, no clock.

What the shim computes for a pod is only as good as what it has seen of it: between a pod's
RunPodSandbox and its last CreateContainer the pod's request is the sum of the containers
created so far, and a restarted shim may know a request less exactly than the one before it.
A value in force that such a transient would lower is kept instead.

``keep_protection`` takes the computed targets (``shim.decision.node.node_targets``: each
target names its pod, whether it is the file the policy protects with, and for a sum the pods
it sums), the values in force ((path, file) -> bytes: what the shim last wrote, else what it
read back), the departures since the last pass (pod uid -> why: a container removed, the
sandbox stopped or removed, the pod gone from the runtime's listing, a request or the overhead
lowered by an update), and returns the targets to write:

* a pod's protecting file: max(computed, in force) -- unless the pod has a departure, then the
  computed value (it goes down, and the write names the departure);
* a QoS / kubepods sum: max(computed, Σ of its pods' values as returned here, in force − how
  far the departed pods' values go down in this pass). A departed pod that is no longer placed
  at all counts against every sum; a departed pod whose value in force is not known takes the
  in-force floor away from the sums it counts against (only the Σ of the pods is kept). On the
  first pass after start (``start``) the sums get no in-force floor: the pods that are running
  are all known then, and what pods gone while the shim was down contributed is not kept;
* every other file (the other file of a pair, a stopped pod, policy None, reserved cgroups):
  as computed.

No value in force above the node's capacity becomes a floor: it is capped there (rounded down
to a page).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from shim.decision.node import POD, Target

Key = tuple[str, str]


def _cap(n: int, cap: int | None) -> int:
    return n if cap is None else min(n, cap)


def keep_protection(
    targets: Mapping[Key, Target],
    in_force: Mapping[Key, int],
    departures: Mapping[str, Sequence[str]],
    capacity: int,
    page_size: int,
    *,
    start: bool = False,
) -> dict[Key, Target]:
    """The targets to write: ``targets`` with values in force kept (module docstring)."""
    page = max(1, page_size)
    cap = (capacity // page) * page if capacity > 0 else None
    out: dict[Key, Target] = dict(targets)

    # -- pods
    pod_value: dict[str, int] = {}  # uid -> its protecting file's value as returned
    drops: dict[str, int | None] = {uid: 0 for uid in departures}  # None: not known
    seen_departed: set[str] = set()
    for key, t in targets.items():
        if t.level != POD or not t.pod:
            continue
        have = in_force.get(key)
        if t.pod in departures:
            seen_departed.add(t.pod)
            why = "; ".join(departures[t.pod])
            if have is not None and have > t.value:
                d = drops[t.pod]
                if d is not None:
                    drops[t.pod] = max(d, _cap(have, cap) - t.value)
                out[key] = replace(t, departure=why, why=f"{t.why}; lowered: {why}")
            elif have is None and t.protecting:
                drops[t.pod] = None
            if t.protecting:
                pod_value[t.pod] = t.value
            continue
        if not t.protecting:
            continue
        value = t.value
        if have is not None and _cap(have, cap) > value:
            value = _cap(have, cap)
            held = f"value in force {have} kept above the computed {t.value}, no pod left" + \
                (f" (capped at the node's {cap})" if cap is not None and have > cap else "")
            out[key] = replace(t, value=value, held=held, why=f"{t.why}; held: {held}")
        pod_value[t.pod] = value
    for uid in departures:
        if uid not in seen_departed:  # none of its files is managed any more: how far it goes is not known
            drops[uid] = None
    placed = set().union(*(t.members for t in targets.values() if t.members)) if targets else set()

    # -- QoS and kubepods sums
    for key, t in targets.items():
        if t.level == POD or not t.protecting:
            continue
        pods_sum = _cap(sum(pod_value.get(uid, 0) for uid in t.members), cap)
        left = [uid for uid in departures if uid in t.members or uid not in placed]
        have = in_force.get(key)
        floor = 0
        if have is not None and not start:
            if any(drops[uid] is None for uid in left):
                floor = 0
            else:
                floor = max(0, _cap(have, cap) - sum(drops[uid] or 0 for uid in left))
        value = max(t.value, pods_sum, floor)
        why = t.why
        held = departure = ""
        if value > t.value:
            if floor >= pods_sum:
                kept = _cap(have, cap)
                held = f"value in force {have} kept" + (
                    f" less {kept - floor} of departed pods" if floor < kept else ", no pod left") + \
                    (f", capped at the node's {cap}" if kept < have else "") + f" (computed {t.value})"
            else:
                held = f"the pods' values in force sum to {pods_sum} (computed {t.value})"
            why += f"; held: {held}"
        if left and have is not None and value < have:
            departure = "; ".join(r for uid in left for r in departures[uid])
            why += f"; lowered: {departure}"
        elif start and have is not None and value < have:
            departure = "start: the sum of the running pods (pods gone while the shim was not running left)"
            why += f"; lowered at {departure}"
        if held or departure:
            out[key] = replace(t, value=value, held=held, departure=departure, why=why)
    return out
