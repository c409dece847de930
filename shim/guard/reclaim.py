"""Proactive reclaim as the monitor runs it (``--reclaim true``): per container, the samples
go to shim.decision.reclaim; a RECLAIM verdict is a write of a byte count to the container's
memory.reclaim (shim.effects.container: the validated walk).

Writes are audited in sums: one ``reclaim`` record per container at most every
``audit_interval`` seconds (the first write of a quiet container at once), and a last one when
the container goes away. A cgroup without memory.reclaim (kernel < 5.19) turns reclaim off for
this shim, said once (``reclaim-error``).
"""
from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Callable

from shim.decision import reclaim as rc
from shim.effects.cgroupfs import PathRefused, ReclaimUnsupported
from shim.effects.container import ContainerCgroups
from shim.effects.rollout import OBSERVE
from shim.guard.sampling import ContainerRef, Reading, parse_flat_keyed

log = logging.getLogger(__name__)

TOTALS = ("writes", "eagain", "errors", "asked_bytes", "freed_bytes", "backoffs", "stalls_avoided",
          "high_events_while_active")


def _new_acc(now: float) -> dict:
    return {"since": now, **dict.fromkeys(TOTALS, 0)}


@dataclass(eq=False)
class ReclaimRunner:
    """The reclaim state of every container the monitor samples, and its writes (through
    ``fs``; records to ``emit``, throttled errors to ``error(key, message)``)."""

    cfg: rc.ReclaimConfig
    fs: ContainerCgroups
    _emit: Callable[[dict], None]
    _error: Callable[[str, str], object]
    page_size: int
    audit_interval: float = 60.0
    _hist: dict[str, collections.deque[rc.Sample]] = field(default_factory=dict)
    _states: dict[str, rc.ReclaimState] = field(default_factory=dict)
    _acc: dict[str, dict] = field(default_factory=dict)  # container id -> sums since its last record
    _emitted: dict[str, float] = field(default_factory=dict)  # container id -> when its last record was emitted
    _pending: dict[str, int] = field(default_factory=dict)  # container id -> memory.events high at its last write
    _freed: dict[str, int] = field(default_factory=dict)  # container id -> bytes freed so far
    unsupported: str | None = None  # why reclaim is off for this shim (no memory.reclaim)
    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOTALS, 0))

    def run(self, ref: ContainerRef, rel: str, r: Reading, stat_text: str | None, now: float) -> None:
        """One container's round: decide on its samples, write, audit when due."""
        cfg = self.cfg
        cid = ref.id
        stat = parse_flat_keyed(stat_text) if stat_text is not None else None
        if stat is not None:
            for k in ("workingset_refault_file", "workingset_refault_anon"):
                if k in stat:  # counted in pages
                    stat[k] *= self.page_size
        high_events = r.events.get("high")
        # "stalls avoided": the interval after a write in which memory.events high did not grow
        if cid in self._pending and high_events is not None:
            grew = high_events - self._pending.pop(cid)
            acc = self._acc.setdefault(cid, _new_acc(now))
            if grew <= 0:
                self.totals["stalls_avoided"] += 1
                acc["stalls_avoided"] += 1
            else:
                self.totals["high_events_while_active"] += grew
                acc["high_events_while_active"] += grew
        r.reclaimed = self._freed.get(cid, 0)
        sample = rc.Sample(t=now, current=r.current, high=r.high, min=r.min, low=r.low,
                           some_avg10=r.pressure.get("some", {}).get("avg10"),
                           full_avg10=r.pressure.get("full", {}).get("avg10"), stat=stat, qos=ref.qos)
        hist = self._hist.get(cid)
        if hist is None:
            hist = self._hist[cid] = collections.deque(maxlen=rc.history_needed(cfg))
        hist.append(sample)
        if self.unsupported is None:
            state = self._states.get(cid, rc.ReclaimState())
            d = rc.decide(list(hist), cfg, state)
            self._states[cid] = d.state
            if d.backoff:
                self.totals["backoffs"] += 1
                acc = self._acc.setdefault(cid, _new_acc(now))
                acc["backoffs"] += 1
                acc["backoff_reason"] = d.reason
                log.info("reclaim: %s (%s): %s", ref.label(), cid[:12], d.reason)
            if d.verdict is rc.Verdict.RECLAIM:
                self._write(ref, rel, r, d, now)
        acc = self._acc.get(cid)
        if acc is not None and (acc["writes"] or acc["backoffs"] or acc["errors"]):
            last = self._emitted.get(cid)
            if last is None or now - last >= self.audit_interval:
                self._record(ref, rel, r, sample, now)

    def _write(self, ref: ContainerRef, rel: str, r: Reading, d, now: float) -> None:
        cid = ref.id
        acc = self._acc.setdefault(cid, _new_acc(now))
        observe = self.fs.rollout.observe  # (observe: the write is decided and counted, not made)
        try:
            out = self.fs.reclaim(rel, d.bytes, observe=observe)
        except FileNotFoundError:  # the cgroup went away meanwhile
            return
        except ReclaimUnsupported as e:
            self.unsupported = str(e)
            log.warning("reclaim: %s; proactive reclaim is off for this shim", e)
            self._emit({"event": "reclaim-error", "container_id": cid, "pod": f"{ref.namespace}/{ref.pod}",
                        "container": ref.container, "path": self.fs.abspath(rel), "file": "memory.reclaim",
                        "error": str(e)[:500], "reclaim_disabled": True})
            return
        except (OSError, ValueError, PathRefused) as e:
            self.totals["errors"] += 1
            acc["errors"] += 1
            acc["error"] = f"{e.__class__.__name__}: {e}"[:500]
            self._error(f"reclaim/{cid}", f"writing {d.bytes} to {self.fs.abspath(rel, 'memory.reclaim')}: {e}")
            return
        freed = out.freed
        self._states[cid] = rc.after_write(self._states[cid], now, d.bytes, freed, out.eagain, self.cfg)
        tot = self.totals
        tot["writes"] += 1
        tot["eagain"] += out.eagain
        tot["asked_bytes"] += d.bytes
        tot["freed_bytes"] += freed
        self._freed[cid] = self._freed.get(cid, 0) + freed
        r.reclaimed = self._freed[cid]
        acc["writes"] += 1
        if observe:
            acc["rollout"] = OBSERVE
        acc["eagain"] += out.eagain
        acc["asked_bytes"] += d.bytes
        acc["freed_bytes"] += freed
        acc["reason"] = d.reason
        if r.events.get("high") is not None:
            self._pending[cid] = r.events["high"]
        if out.after is not None:
            r.current = out.after
        log.debug("reclaim: %s asked %d, freed %d%s: %s", ref.label(), d.bytes, freed,
                  " (EAGAIN)" if out.eagain else "", d.reason)

    def _record(self, ref: ContainerRef | None, rel: str | None, r: Reading | None, sample, now: float,
                cid: str | None = None) -> None:
        cid = cid or ref.id
        acc = self._acc.pop(cid, None)
        if not acc:
            return
        self._emitted[cid] = now
        record = {"event": "reclaim", "container_id": cid, "file": "memory.reclaim",
                  "period_s": round(now - acc["since"], 3), **{k: v for k, v in acc.items() if k != "since"}}
        if ref is not None:
            record.update(pod=f"{ref.namespace}/{ref.pod}", pod_uid=ref.uid, container=ref.container,
                          path=self.fs.abspath(rel))
        if r is not None:
            record.update(memory_current=r.current, memory_high="max" if r.high is None else r.high,
                          some_avg10=sample.some_avg10, full_avg10=sample.full_avg10,
                          reclaimed_total_bytes=self._freed.get(cid, 0))
        self._emit(record)

    def forget(self, alive: set[str], now: float) -> None:
        """Drop the containers not in ``alive``, auditing what they had not yet."""
        for cid in [c for c in set(self._hist) | set(self._acc) | set(self._emitted) if c not in alive]:
            if self._acc.get(cid):
                self._record(None, None, None, None, now, cid=cid)
            for d in (self._hist, self._states, self._acc, self._emitted, self._pending, self._freed):
                d.pop(cid, None)

