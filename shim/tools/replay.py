"""`memqos-shim replay`: run a recorded trace through the shim's real request path.

The request path is the one `serve` runs: the HTTP/2 relay on a real unix socket with the hooks built by ``shim.app.service.build_container_qos`` and ``shim.container.chain.build_request_hooks``.
Upstream is a ``TraceRuntime`` answering every call with the recorded answer (so container ids
and sandbox facts are the recorded ones). A client (``shim.transport.unary_client``) sends
every recorded request, one at a time, in recorded start order, with the call's seq as
``memqos-replay-seq`` metadata (see
shim.tools.trace_runtime for how calls are matched). The audit records the hooks emit -- one per
CreateContainer / UpdateContainerResources -- are the result, each tagged with the seq of
the call that produced it.

Node facts come from the trace header (mem_total_bytes, page_size, cgroup_driver,
kubelet_config); a memqos-shim recording also stores every deciding setting it decided with
(``shim.settings``: the options marked ``decides=True``, shim.app.decides). Each deciding
setting: flag > ``--config`` file > trace header (``shim.settings``, then the older keys
shim.policy / allocatable / factor / kubelet_version) > built-in default; the summary line
names each one's origin, and a note names those the header does not carry. A known setting of
the ``--config`` file that replay does not use is named in a note (shim.app.config_unused).
``--kubelet-config`` and ``--mem-total`` are flags only: they replace the header's node facts
(and the allocatable memory is computed anew from them).

The replay also checks the path itself: every answer the client gets must be the recorded
one (code, details, response bytes) and every request the runtime receives must be the
recorded one apart from the fields the shim owns. Any difference is a replay problem (exit 3).
For a memqos-shim recording, forwarded bytes that differ from the recorded ``forwarded`` are
reported as notes (expected when flags change the settings).

``--expect`` takes a stored ``--json`` output or the audit log of the run that recorded the
trace (its call records; ``time`` never compared, ``seq`` where the file has it).

Exit codes: 0 ok; 1 the records differ from ``--expect``; 2 usage, unreadable trace or
config; 3 the replay did not reproduce the recorded traffic.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, TextIO

from shim.app.settings import Config
from shim.decision import NodeFacts, Policy
from shim.evidence.trace import Trace, TraceCall, TraceError, TraceHeader, read_trace
from shim.node.facts import KubeletFacts, kubelet_facts_from_dict, load_kubelet_config, node_facts

CALL_TIMEOUT = 10.0
# Audit record keys shown first, in this order; the rest follow as the hooks wrote them.
RECORD_KEY_ORDER = (
    "seq", "method", "event", "pod", "pod_uid", "container", "container_id", "sandbox_id",
    "qos", "qos_source", "request", "request_source", "request_note", "limit",
    "unified_before", "unified_after", "reasons",
)
VOLATILE_KEYS = frozenset({"time"})


class ReplayError(Exception):
    """The replay could not be set up (bad settings, missing node facts)."""


@dataclass(frozen=True)
class ReplaySettings:
    node: NodeFacts
    policy: Policy
    enabled: bool  # False when the recording shim had injection off (cgroup v1)
    kubelet: KubeletFacts
    origin: dict[str, str]  # "capacity" and each deciding setting's name -> where its value came from
    # the recorded kubelet's version (the recording's kubelet-version setting, or a trace header
    # source "Kubernetes v1.23.16"): what it writes itself and so which unified keys the shim keeps
    kubelet_version: tuple[int, int] | None = None
    # the deciding settings (shim.app.decides) as replayed, each resolved as the node was
    config: Config = field(default_factory=Config)
    # the deciding settings the header does not carry, with the default each took
    defaults: tuple[str, ...] = ()

    @property
    def mode(self) -> str:
        return self.config.mode

    def ownership(self):
        from shim.node.kubelet import kubelet_writes, ownership

        return ownership(kubelet_writes(self.kubelet, self.kubelet_version), self.policy)

    def describe(self) -> str:
        from shim.app.decides import DECIDING, attr

        parts = [f"capacity {self.node.capacity} ({self.origin['capacity']})"]
        parts += [f"{o.name} {shown(getattr(self.config, attr(o)))} ({self.origin[o.name]})" for o in DECIDING]
        parts.append(f"cgroup driver {self.kubelet.cgroup_driver}")
        if not self.enabled:
            parts.append("injection OFF as recorded")
        return ", ".join(parts)

    def defaults_note(self) -> str | None:
        """The note for a trace whose header does not carry every deciding setting."""
        if not self.defaults:
            return None
        return ("the trace header does not carry " + ", ".join(self.defaults) + "; replayed with "
                + ", ".join(f"{name} {shown(getattr(self.config, name.replace('-', '_')))}"
                            for name in self.defaults))


def shown(value: Any) -> str:
    """A setting's value as the summary says it: JSON, strings and numbers without quotes."""
    from shim.app.decides import json_form

    value = json_form(value)
    if value is None:
        return "none"
    return value if isinstance(value, str) else json.dumps(value)


_UNSET: Any = object()
# the two header names of trace-format.md's shim.policy that are not the upstream ones
RECORDED_POLICY_NAMES = {"request": "Hard", "tiered": "TieredReservation"}
FROM_HEADER = "trace header"


def _older_keys(header: TraceHeader) -> dict[str, Any]:
    """The deciding settings a header carries outside ``shim.settings``: the keys a recording
    had before it (shim.policy, shim.allocatable, shim.factor, shim.kubelet_version), the node's
    page size, the kubelet's version in a kubelet trace's ``source``."""
    shim = header.shim
    out: dict[str, Any] = {}
    if shim.get("policy"):
        try:
            out["policy"] = Policy(RECORDED_POLICY_NAMES.get(shim["policy"], shim["policy"]))
        except ValueError:
            raise ReplayError(f"the trace header names an unknown policy {shim['policy']!r}") from None
    if isinstance(shim.get("allocatable"), int):
        out["node-allocatable"] = shim["allocatable"]
    if "factor" in shim:
        out["factor"] = shim["factor"]
    if header.page_size:
        out["page-size"] = header.page_size
    if shim.get("kubelet_version"):
        out["kubelet-version"] = str(shim["kubelet_version"])
    elif found := re.search(r"Kubernetes v(\d+\.\d+)", header.source):
        out["kubelet-version"] = found.group(1)
    return out


def replay_settings(
    header: TraceHeader,
    *,
    mem_total: int | None = None,
    kubelet_config: str | None = None,
    page_size: int | None = None,
    allocatable: int | None = None,
    factor: Any = _UNSET,  # a float, None (no memory.high) or "auto"; unset: header, else auto
    policy: Policy | None = None,
    given: Mapping[str, tuple[Any, str]] | None = None,
) -> ReplaySettings:
    """Node facts and the deciding settings (shim.app.decides) for replaying a trace. ``given``:
    {setting name: (parsed value, where it came from)} from flags and --config; the keyword
    arguments page_size .. policy are flags too. Precedence: given > the header's
    ``shim.settings`` > the header's older keys > the default."""
    from shim.app.config import ConfigError
    from shim.app.decides import DECIDING, attr, parse_recorded
    from shim.app.service import decided_node
    from shim.node.kubelet import parse_version

    given = dict(given or {})
    for name, value in (("page-size", page_size), ("node-allocatable", allocatable), ("policy", policy)):
        if value is not None:
            given.setdefault(name, (value, "flag"))
    if factor is not _UNSET:
        given.setdefault("factor", (factor, "flag"))
    origin: dict[str, str] = {}

    if mem_total is not None:
        capacity, origin["capacity"] = mem_total, "flag"
    elif header.mem_total_bytes:
        capacity, origin["capacity"] = header.mem_total_bytes, FROM_HEADER
    else:
        raise ReplayError("the trace header has no node.mem_total_bytes; pass --mem-total")

    if kubelet_config is not None:
        kubelet = load_kubelet_config(kubelet_config)
    else:
        doc = dict(header.kubelet_config or {})
        if "cgroupDriver" not in doc and header.cgroup_driver:
            doc["cgroupDriver"] = header.cgroup_driver
        kubelet = kubelet_facts_from_dict(doc, "trace header")
    if kubelet.problems:
        raise ReplayError("kubelet config: " + "; ".join(kubelet.problems))

    recorded = header.shim.get("settings")
    recorded = recorded if isinstance(recorded, Mapping) else {}
    older = _older_keys(header)
    # another capacity or KubeletConfiguration than the recording's: allocatable computed anew
    new_node = kubelet_config is not None or mem_total is not None
    values: dict[str, Any] = {}
    defaults = []
    for o in DECIDING:
        if o.name in given:
            value, where = given[o.name]
        elif o.name == "node-allocatable" and new_node:
            value, where = None, "capacity - kubeReserved - systemReserved"
        elif o.name in recorded:
            try:
                value, where = parse_recorded(o, recorded[o.name]), FROM_HEADER
            except ConfigError as e:
                raise ReplayError(f"{e} (a flag or --config can give the setting instead)") from None
        elif o.name in older:
            value, where = older[o.name], FROM_HEADER
        else:
            value, where = o.default, "default"
            defaults.append(o.name)
        values[attr(o)], origin[o.name] = value, where
    if origin["node-allocatable"] == "default":
        origin["node-allocatable"] = "capacity - kubeReserved - systemReserved"
        defaults.remove("node-allocatable")  # from the header's node facts, as the recording node did
    if origin["factor"] == "default" and kubelet.memory_throttling_factor is not None:
        origin["factor"] = "kubelet memoryThrottlingFactor"
        defaults.remove("factor")
    if origin["page-size"] == "default":
        values["page_size"], origin["page-size"] = os.sysconf("SC_PAGE_SIZE"), "this system (not in the header)"
    if str(values["kubelet_version"]).lower() == "auto":  # nothing is run here: not known
        values["kubelet_version"] = "unknown"
    cfg = Config(**values)
    node = decided_node(cfg, kubelet, capacity, cfg.page_size)
    cfg = replace(cfg, node_allocatable=node.allocatable, factor=node.factor, page_size=node.page_size)
    enabled = header.shim.get("enabled", True) is not False
    return ReplaySettings(node=node, policy=cfg.policy, enabled=enabled, kubelet=kubelet, origin=origin,
                          kubelet_version=parse_version(cfg.kubelet_version), config=cfg,
                          defaults=tuple(defaults))


@dataclass
class CallOutcome:
    call: TraceCall
    code: str
    details: str
    responses: list[bytes]

    def problem(self) -> str | None:
        c = self.call
        where = f"seq {c.seq} {c.method}"
        if self.code != c.code:
            return f"{where}: code {self.code} ({self.details!r}), recorded {c.code} ({c.details!r})"
        if c.code != "OK":
            if self.details != c.details:
                return f"{where}: details {self.details!r}, recorded {c.details!r}"
            return None
        expected = c.responses if c.responses else [b""]
        got = self.responses if self.responses else [b""]
        if got != expected:
            return f"{where}: {len(got)} response(s) differ from the {len(expected)} recorded"
        return None


@dataclass
class ReplayResult:
    trace: str
    settings: ReplaySettings
    calls: int = 0
    records: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    forwarded: dict[int, bytes] = field(default_factory=dict)  # seq -> what the runtime received
    matched_by: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        how = ", ".join(f"{k} {v}" for k, v in sorted(self.matched_by.items()))
        return (f"replayed {self.calls} calls from {self.trace} in {self.seconds:.2f} s "
                f"(matched by {how or 'nothing'}): {len(self.records)} audit records, "
                f"{len(self.problems)} problems, {len(self.notes)} notes; {self.settings.describe()}")


def _streaming(call: TraceCall) -> bool:
    from shim.cri.methods import CRI_METHODS_BY_PATH

    known = CRI_METHODS_BY_PATH.get(call.method)
    if known is not None:
        return known.server_streaming
    return len(call.responses) > 1


def send_call(client, call: TraceCall, *, timeout: float = CALL_TIMEOUT, metadata: tuple = ()) -> CallOutcome:
    """Send one recorded request as raw bytes on ``client`` (a ``UnaryClient``); return what
    came back. Blocking: ``drive`` runs it on a thread."""
    from shim.transport.unary_client import CallError

    try:
        responses = client.call_messages(call.method, call.request, timeout, metadata)
    except CallError as e:
        return CallOutcome(call, e.code, e.details, [])
    if not _streaming(call) and not responses:
        responses = [b""]
    return CallOutcome(call, "OK", "", responses)


async def drive(target: str, calls: Iterable[TraceCall], *,
                before: Callable[[TraceCall], None] | None = None,
                after: Callable[[CallOutcome], None] | None = None,
                timeout: float = CALL_TIMEOUT, tag_seq: bool = True) -> list[CallOutcome]:
    """Send ``calls`` (already in the wanted order) one at a time to ``target`` (unix://...),
    each on a thread (the shim and the runtime may run on this event loop)."""
    from shim.tools.trace_runtime import MAX_MESSAGE, REPLAY_SEQ_KEY
    from shim.transport.unary_client import UnaryClient

    outcomes = []
    client = UnaryClient(target, max_message_bytes=MAX_MESSAGE)
    try:
        for call in calls:
            if before is not None:
                before(call)
            md = ((REPLAY_SEQ_KEY, str(call.seq)),) if tag_seq else ()
            outcome = await asyncio.to_thread(send_call, client, call, timeout=timeout, metadata=md)
            if after is not None:
                after(outcome)
            outcomes.append(outcome)
    finally:
        client.close()
    return outcomes


def ordered_record(seq: int | None, record: dict) -> dict:
    out: dict[str, Any] = {"seq": seq}
    for key in RECORD_KEY_ORDER[1:]:
        if key in record:
            out[key] = record[key]
    for key, value in record.items():
        if key not in out and key not in VOLATILE_KEYS:
            out[key] = value
    # JSON types only (tuples, mapping proxies), so a record equals its stored form
    return json.loads(json.dumps(out, default=str))


async def replay_async(trace: Trace, settings: ReplaySettings, *, timeout: float = CALL_TIMEOUT,
                       mode: str | None = None) -> ReplayResult:
    from shim.app.service import build_container_qos
    from shim.container.chain import build_request_hooks
    from shim.cri.methods import CRI_METHODS
    from shim.effects.rollout import Rollout
    from shim.tools.trace_runtime import TraceRuntime
    from shim.transport.relay import RelayProxy

    result = ReplayResult(trace=trace.path, settings=settings)
    t0 = time.perf_counter()
    current: list[int | None] = [None]

    def emit(record: dict) -> None:
        result.records.append(ordered_record(current[0], record))

    qos = build_container_qos(settings.node, settings.policy, emit, cgroup_v2=settings.enabled,
                              cgroup_root="(the recording node)", ownership=settings.ownership(),
                              rollout=Rollout(mode or settings.mode))
    hooks = build_request_hooks(qos)
    workdir = tempfile.mkdtemp(prefix="memqos-replay-")
    runtime = TraceRuntime(trace.calls)
    proxy = None
    try:
        await runtime.start(os.path.join(workdir, "runtime.sock"))
        proxy = RelayProxy("unix://" + os.path.join(workdir, "shim.sock"), runtime.endpoint, hooks, methods=CRI_METHODS)
        await proxy.start()

        def before(call: TraceCall) -> None:
            current[0] = call.seq

        def after(outcome: CallOutcome) -> None:
            result.calls += 1
            problem = outcome.problem()
            if problem:
                result.problems.append(problem)

        await drive("unix://" + proxy.listen_path, trace.in_start_order(), before=before, after=after,
                    timeout=timeout)
    finally:
        if proxy is not None:
            await proxy.stop(None)
        await runtime.stop(None)
        shutil.rmtree(workdir, ignore_errors=True)

    recorded_by_shim = bool(trace.header.shim)
    for a in runtime.answered:
        result.matched_by[a.matched_by] += 1
        if a.seq is None:
            result.problems.append(f"{a.method}: the runtime had no recorded call left to answer it")
            continue
        call = runtime.call_for(a)
        if call.forwarded is not None or a.request != call.request:
            result.forwarded[a.seq] = a.request
        if not a.request_matches:
            result.problems.append(f"seq {a.seq} {a.method}: the runtime received a request that differs "
                                   f"from the recorded one beyond the fields the shim owns")
        elif recorded_by_shim and a.request != call.upstream_request:
            result.notes.append(f"seq {a.seq} {a.method}: forwarded bytes differ from the recording's")
    result.seconds = time.perf_counter() - t0
    return result


def replay(trace: Trace, settings: ReplaySettings, *, timeout: float = CALL_TIMEOUT,
           mode: str | None = None) -> ReplayResult:
    """Synchronous wrapper (its own event loop). ``mode``: enforce or observe (decided and
    audited, the kubelet's bytes forwarded); default: the settings' mode."""
    return asyncio.run(replay_async(trace, settings, timeout=timeout, mode=mode))


# -- output ------------------------------------------------------------------------
def records_jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def _unified_text(unified: dict) -> str:
    """The values as the cgroup files get them (decimal bytes)."""
    if not unified:
        return "{}"
    return " ".join(f"{k}={unified[k]}" for k in sorted(unified))


def records_table(records: list[dict]) -> str:
    from shim.decision.quantity import format_bytes

    head = ("SEQ", "METHOD", "EVENT", "POD", "CONTAINER", "QOS", "REQUEST", "SOURCE", "LIMIT",
            "UNIFIED BEFORE", "UNIFIED AFTER")
    rows = [head]
    for r in records:
        req = r.get("request")
        limit = r.get("limit")
        rows.append((
            str(r.get("seq", "")),
            str(r.get("method", "")),
            str(r.get("event", "")),
            str(r.get("pod", "")) or "-",
            str(r.get("container", "")) or "-",
            str(r.get("qos", "-")),
            format_bytes(req) if isinstance(req, int) and req else ("0" if req == 0 else "-"),
            str(r.get("request_source", "-")),
            format_bytes(limit) if isinstance(limit, int) and limit else "none",
            _unified_text(r.get("unified_before", {})) if "unified_before" in r else "-",
            _unified_text(r.get("unified_after", {})) if "unified_after" in r else (r.get("error") or "-"),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    lines = []
    for row in rows:
        cells = [row[i].ljust(widths[i]) for i in range(len(head) - 1)] + [row[-1]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines) + "\n"


def call_records(records: list[dict]) -> list[dict]:
    """The records of calls (those naming a method): all of a stored --json output; of an audit
    log (`serve`'s own, for --expect) the records a replay makes, without the start record,
    the reconciler's, the guard's."""
    return [r for r in records if "method" in r]


def _comparable(record: dict, seq: bool) -> dict:
    return {k: v for k, v in record.items() if k not in VOLATILE_KEYS and (seq or k != "seq")}


def compare_records(expected: list[dict], got: list[dict]) -> list[str]:
    """Differences between stored and produced records, one line each. ``time`` is never
    compared, ``seq`` only where the stored record has one (an audit log's records have none)."""
    out = []
    for i in range(max(len(expected), len(got))):
        if i >= len(got):
            out.append(f"record {i + 1} (seq {expected[i].get('seq')}): missing, expected {json.dumps(expected[i])}")
            continue
        if i >= len(expected):
            out.append(f"record {i + 1} (seq {got[i].get('seq')}): unexpected {json.dumps(got[i])}")
            continue
        e, g = _comparable(expected[i], True), _comparable(got[i], "seq" in expected[i])
        if e == g:
            continue
        for key in list(e) + [k for k in g if k not in e]:
            if e.get(key, _MISSING) != g.get(key, _MISSING):
                ev = json.dumps(e[key]) if key in e else "(absent)"
                gv = json.dumps(g[key]) if key in g else "(absent)"
                out.append(f"record {i + 1} (seq {g.get('seq')}, {g.get('pod')}/{g.get('container')}): "
                           f"{key}: expected {ev}, got {gv}")
    return out


_MISSING = object()


def load_records(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# -- CLI -----------------------------------------------------------------------------
def _replay_options():
    """The settings replay takes: the deciding ones (shim.app.decides)."""
    from shim.app.decides import DECIDING

    return DECIDING


def given_settings(cfg, config_path: str | None) -> dict[str, tuple[Any, str]]:
    """{name: (value, origin)} of the deciding settings a flag or the --config file gives;
    ``kubelet-version: auto`` is left to the recording (nothing is run to find a version here)."""
    from shim.app.decides import DECIDING, attr

    out = {}
    for o in DECIDING:
        where = cfg.origin.get(attr(o), "default")
        value = getattr(cfg, attr(o))
        if where == "default" or (o.name == "kubelet-version" and str(value).lower() == "auto"):
            continue
        out[o.name] = (value, "flag" if where == "flag" else f"--config {config_path}")
    return out


def cmd_replay(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    from shim.app.config import ConfigError, resolve
    from shim.app.config_unused import unused_note
    from shim.decision.quantity import QuantityError, parse_bytes

    out = out or sys.stdout
    err = err or sys.stderr
    try:
        cfg = resolve(args, _replay_options())
        mem_total = parse_bytes(args.mem_total) if args.mem_total else None
        unused = unused_note("replay", args.config, _replay_options())
    except (ConfigError, QuantityError) as e:
        print(f"memqos-shim replay: {e}", file=err)
        return 2
    try:
        trace = read_trace(args.trace)
        settings = replay_settings(trace.header, mem_total=mem_total, kubelet_config=args.kubelet_config,
                                   given=given_settings(cfg, args.config))
    except (TraceError, ReplayError) as e:
        print(f"memqos-shim replay: {e}", file=err)
        return 2
    if unused:
        print(f"memqos-shim replay: {unused}", file=err)
    if (defaults := settings.defaults_note()) is not None:
        print(f"memqos-shim replay: note: {defaults}", file=err)
    for problem in trace.problems:
        print(f"memqos-shim replay: note: {problem}", file=err)
    result = replay(trace, settings)
    if args.json:
        out.write(records_jsonl(result.records))
    else:
        out.write(records_table(result.records))
    print(result.summary(), file=err)
    for note in result.notes[:20]:
        print(f"  note: {note}", file=err)
    for problem in result.problems[:50]:
        print(f"  PROBLEM: {problem}", file=err)
    if len(result.problems) > 50:
        print(f"  ... {len(result.problems) - 50} more problems", file=err)
    if args.expect:
        try:
            expected = call_records(load_records(args.expect))
        except (OSError, ValueError) as e:
            print(f"memqos-shim replay: --expect {args.expect}: {e}", file=err)
            return 2
        diffs = compare_records(expected, result.records)
        if diffs:
            print(f"DIFFERS from {args.expect}: {len(diffs)} difference(s)", file=err)
            for d in diffs[:100]:
                print(f"  {d}", file=err)
            return 1
        print(f"same as {args.expect} ({len(expected)} records)", file=err)
    return 0 if result.ok else 3


def register(subparsers) -> None:
    from shim.app.config import add_arguments

    p = subparsers.add_parser(
        "replay",
        help="replay a CRI trace through the shim's request path and print its audit records",
        description="Replay a cri-trace through a real proxy with the shim's hooks, in front of a fake "
                    "runtime answering with the recorded responses. Node facts and the settings that "
                    "change decisions come from the trace header; flags and --config override them "
                    "(--kubelet-version auto: the recording's; nothing is run). "
                    "Exit: 0 ok, 1 differs from --expect, "
                    "2 usage/trace error, 3 the replay did not reproduce the recorded traffic.",
    )
    p.add_argument("trace", metavar="TRACE", help="cri-trace file (JSON lines)")
    add_arguments(p, _replay_options())
    p.add_argument("--mem-total", metavar="Q", default=None,
                   help="node memory capacity (quantity), instead of the header's mem_total_bytes")
    p.add_argument("--kubelet-config", metavar="FILE", default=None,
                   help="KubeletConfiguration file to use instead of the header's kubelet_config")
    p.add_argument("--json", action="store_true", help="one JSON object per audit record and line")
    p.add_argument("--expect", metavar="FILE",
                   help="compare the records with a stored --json output, or with the audit log of the "
                        "run that recorded the trace; exit 1 on any difference")
    p.set_defaults(func=cmd_replay)
