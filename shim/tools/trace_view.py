"""`memqos-shim trace show`: a cri-trace decoded to readable JSON.

Each call's request (and ``forwarded`` bytes) and responses are parsed with the project's
runtime.v1 proto and printed in the proto3 JSON mapping (field names as in the .proto,
int64 as strings, bytes as base64). Methods of another CRI version with the same service and
method name (``/runtime.v1alpha2.RuntimeService/Version``) are decoded with the v1 types,
which are wire-compatible for what both versions have; the output says so in
``decoded_as``. Fields the proto does not know are listed under ``_unknown_fields`` rather
than silently dropped. A method without a proto (``NoSuch``) keeps its bytes as base64.

Output: the header, then one JSON value per call, indented (``--compact``: one per line) --
a stream that ``jq`` reads as is.
"""
from __future__ import annotations

import argparse
import base64
import datetime as _dt
import json
import re
import sys
from typing import Any, TextIO

from google.protobuf.json_format import MessageToDict

from shim.cri import pb
from shim.evidence.trace import Trace, TraceCall, TraceError, read_trace

V1_PACKAGE = "runtime.v1"


def message_types(method: str) -> tuple[Any, Any, str] | None:
    """(request class, response class, what they are) for a gRPC method path, or None."""
    try:
        _, service_full, name = method.split("/", 2)
        package, service = service_full.rsplit(".", 1)
    except ValueError:
        return None
    svc = pb.DESCRIPTOR.services_by_name.get(service)
    if svc is None:
        return None
    m = svc.methods_by_name.get(name)
    if m is None:
        return None
    req, resp = getattr(pb, m.input_type.name, None), getattr(pb, m.output_type.name, None)
    if req is None or resp is None:
        return None
    what = f"{V1_PACKAGE}.{service}/{name}"
    if package != V1_PACKAGE:
        what += f" (wire-compatible stand-in for {package})"
    return req, resp, what


def _unknown_fields(msg: Any, path: str = "") -> list[dict[str, Any]]:
    from google.protobuf import unknown_fields

    out = [
        {"path": path or ".", "field": f.field_number, "wire_type": f.wire_type}
        for f in unknown_fields.UnknownFieldSet(msg)
    ]
    for fd, value in msg.ListFields():
        if fd.message_type is None:
            continue
        sub = f"{path}.{fd.name}"
        if fd.message_type.GetOptions().map_entry:
            for k, v in value.items():
                if hasattr(v, "ListFields"):
                    out += _unknown_fields(v, f"{sub}[{k!r}]")
        elif fd.is_repeated:
            for i, item in enumerate(value):
                out += _unknown_fields(item, f"{sub}[{i}]")
        else:
            out += _unknown_fields(value, sub)
    return out


def decode_message(cls: Any, data: bytes) -> dict[str, Any]:
    """The message as JSON-ready dict; on a parse error the bytes as base64 and the error."""
    try:
        msg = cls.FromString(data)
    except Exception as e:
        return {"_undecoded_base64": base64.b64encode(data).decode(), "_error": f"{e.__class__.__name__}: {e}"}
    out = MessageToDict(msg, preserving_proto_field_name=True)
    unknown = _unknown_fields(msg)
    if unknown:
        out["_unknown_fields"] = unknown
    return out


def _iso(ts: float) -> str:
    try:
        return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    except (OverflowError, OSError, ValueError):
        return ""


def call_view(call: TraceCall) -> dict[str, Any]:
    out: dict[str, Any] = {
        "seq": call.seq,
        "time": _iso(call.start),
        "start": call.start,
        "duration_ms": call.duration_ms,
        "method": call.method,
        "code": call.code,
    }
    if call.details:
        out["details"] = call.details
    types = message_types(call.method)
    if types is None:
        out["decoded_as"] = None
        out["note"] = "no proto for this method in runtime.v1; bytes shown as base64"
        out["request_base64"] = base64.b64encode(call.request).decode()
        if call.forwarded is not None:
            out["forwarded_base64"] = base64.b64encode(call.forwarded).decode()
        out["responses_base64"] = [base64.b64encode(r).decode() for r in call.responses]
    else:
        req_cls, resp_cls, what = types
        out["decoded_as"] = what
        out["request"] = decode_message(req_cls, call.request)
        if call.forwarded is not None:
            out["forwarded"] = decode_message(req_cls, call.forwarded)
        out["responses"] = [decode_message(resp_cls, r) for r in call.responses]
    if call.truncated:
        out["truncated"] = True
    return out


def show(trace: Trace, out: TextIO, *, method: str | None = None, seqs: set[int] | None = None,
         compact: bool = False, header: bool = True) -> int:
    """Write the decoded trace; returns the number of calls shown."""
    pattern = re.compile(method) if method else None
    indent = None if compact else 2

    def emit(obj: Any) -> None:
        out.write(json.dumps(obj, indent=indent, ensure_ascii=False, default=str) + "\n")

    if header:
        emit({"header": trace.header.raw, **({"problems": trace.problems} if trace.problems else {})})
    n = 0
    for call in trace.calls:
        if pattern is not None and not pattern.search(call.method):
            continue
        if seqs is not None and call.seq not in seqs:
            continue
        emit(call_view(call))
        n += 1
    return n


def _parse_seqs(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            a, b = part.split("-", 1)
            out.update(range(int(a), int(b) + 1))
        elif part:
            out.add(int(part))
    return out


def cmd_show(args: argparse.Namespace) -> int:
    try:
        pattern = args.method
        if pattern:
            re.compile(pattern)
        seqs = _parse_seqs(args.seq) if args.seq else None
    except (re.error, ValueError) as e:
        print(f"memqos-shim trace show: {e}", file=sys.stderr)
        return 2
    try:
        trace = read_trace(args.trace)
    except TraceError as e:
        print(f"memqos-shim trace show: {e}", file=sys.stderr)
        return 2
    try:
        n = show(trace, sys.stdout, method=pattern, seqs=seqs, compact=args.compact, header=not args.no_header)
    except BrokenPipeError:  # | head
        return 0
    print(f"{n} of {len(trace.calls)} calls shown", file=sys.stderr)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("trace", help="inspect cri-trace files")
    sub = p.add_subparsers(dest="trace_command", metavar="SUBCOMMAND")
    show_p = sub.add_parser("show", help="decode every call of a trace to readable JSON",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    show_p.add_argument("trace", metavar="TRACE", help="cri-trace file (JSON lines)")
    show_p.add_argument("--method", metavar="REGEX", help="only methods whose full path matches (re.search)")
    show_p.add_argument("--seq", metavar="LIST", help="only these seq numbers, e.g. 93,96-99")
    show_p.add_argument("--compact", action="store_true", help="one JSON object per line")
    show_p.add_argument("--no-header", action="store_true", help="leave out the header")
    show_p.set_defaults(func=cmd_show)

    def usage(args: argparse.Namespace) -> int:
        p.print_help()
        return 2

    p.set_defaults(func=usage)
