"""The CRI trace format, version 1 (docs/trace-format.md): read and write.

A trace is JSON Lines: a header object, then one object per finished RPC with the raw
protobuf bytes in standard base64. This module only moves bytes between that text form and
``TraceCall``; it never parses protobuf (``shim.tools.trace_view`` does, for people).

Reading is strict about what the format requires (a header first, the required keys and
types of every call line, valid base64) and lenient about what it allows: unknown keys are
ignored, ``seq`` need not be contiguous, and a last line cut short (a recorder killed in the
middle of a write) is skipped with a note in ``Trace.problems``.

Files ending in ``.gz`` or ``.xz`` (``calls.jsonl.xz``) are decompressed on the fly when
read; the recorder writes plain ``.jsonl``.
"""
from __future__ import annotations

import base64
import binascii
import datetime as _dt
import gzip
import json
import lzma
from dataclasses import dataclass, field
from typing import Any, Iterator, TextIO

FORMAT = "cri-trace"
VERSION = 1
# what a trace file's name may end with; compressed ones are read transparently
SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.xz")


class TraceError(ValueError):
    """The file is not a readable cri-trace (message names the file and line)."""


@dataclass
class TraceCall:
    """One finished RPC: a call line of the trace."""

    seq: int
    start: float
    duration_ms: float
    method: str
    request: bytes
    forwarded: bytes | None = None
    responses: list[bytes] = field(default_factory=list)
    code: str = "OK"
    details: str = ""
    truncated: bool = False  # written as "truncated": true only when set (an extension)

    @classmethod
    def from_finished(cls, call: Any, seq: int) -> "TraceCall":
        """From a shim.transport.hooks.RpcCall."""
        return cls(
            seq=seq,
            start=call.start,
            duration_ms=call.duration_ms,
            method=call.method,
            request=bytes(call.request),
            forwarded=None if call.forwarded is None else bytes(call.forwarded),
            responses=[bytes(r) for r in call.responses],
            code=call.code,
            details=call.details,
            truncated=bool(getattr(call, "truncated", False)),
        )

    @property
    def name(self) -> str:
        """The method's last path element: "CreateContainer"."""
        return self.method.rsplit("/", 1)[-1]

    @property
    def upstream_request(self) -> bytes:
        """What the runtime received: ``forwarded`` when the request was rewritten."""
        return self.request if self.forwarded is None else self.forwarded

    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "seq": self.seq,
            "start": self.start,
            "duration_ms": round(self.duration_ms, 3),
            "method": self.method,
            "request": _b64(self.request),
        }
        if self.forwarded is not None:
            obj["forwarded"] = _b64(self.forwarded)
        obj["responses"] = [_b64(r) for r in self.responses]
        obj["code"] = self.code
        obj["details"] = self.details
        if self.truncated:
            obj["truncated"] = True
        return obj

    def to_line(self) -> str:
        """The call as one line of text, newline included."""
        return json.dumps(self.to_json()) + "\n"


@dataclass
class TraceHeader:
    """Line 1. ``raw`` is the whole object, unknown keys included."""

    raw: dict[str, Any]

    @property
    def created(self) -> str:
        return str(self.raw.get("created", ""))

    @property
    def source(self) -> str:
        return str(self.raw.get("source", ""))

    @property
    def node(self) -> dict[str, Any]:
        node = self.raw.get("node")
        return node if isinstance(node, dict) else {}

    @property
    def mem_total_bytes(self) -> int | None:
        return _int_or_none(self.node.get("mem_total_bytes"))

    @property
    def page_size(self) -> int | None:
        return _int_or_none(self.node.get("page_size"))

    @property
    def cgroup_driver(self) -> str | None:
        v = self.node.get("cgroup_driver")
        return v if isinstance(v, str) else None

    @property
    def kubelet_config(self) -> dict[str, Any] | None:
        v = self.node.get("kubelet_config")
        return v if isinstance(v, dict) else None

    @property
    def shim(self) -> dict[str, Any]:
        """Settings of the memqos-shim that recorded the trace ({} for other recorders)."""
        v = self.raw.get("shim")
        return v if isinstance(v, dict) else {}

    def to_line(self) -> str:
        return json.dumps(self.raw, default=str) + "\n"


@dataclass
class Trace:
    header: TraceHeader
    calls: list[TraceCall]
    path: str = ""
    problems: list[str] = field(default_factory=list)

    def in_start_order(self) -> list[TraceCall]:
        """Calls in the order they began (``start``, then ``seq``)."""
        return sorted(self.calls, key=lambda c: (c.start, c.seq))

    def methods(self) -> list[str]:
        return sorted({c.method for c in self.calls})


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: Any, what: str) -> bytes:
    if not isinstance(text, str):
        raise ValueError(f"{what} is not a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{what} is not valid base64 ({e})") from None


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def make_header(
    *,
    source: str,
    mem_total_bytes: int,
    page_size: int,
    cgroup_driver: str,
    kubelet_config: dict[str, Any] | None,
    created: str | None = None,
    node_extra: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A header object. ``node_extra`` adds keys to ``node``, ``extra`` top-level keys
    (readers ignore keys they do not know)."""
    node: dict[str, Any] = {
        "mem_total_bytes": mem_total_bytes,
        "page_size": page_size,
        "cgroup_driver": cgroup_driver,
        "kubelet_config": kubelet_config if kubelet_config is not None else {},
    }
    node.update(node_extra or {})
    header: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "created": created or utc_now(),
        "source": source,
        "node": node,
    }
    header.update(extra or {})
    return header


def parse_header(obj: Any, where: str = "line 1") -> TraceHeader:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: the header is not a JSON object")
    if obj.get("format") != FORMAT:
        raise TraceError(f"{where}: not a cri-trace header (format {obj.get('format')!r}, expected {FORMAT!r})")
    version = obj.get("version")
    if version != VERSION:
        raise TraceError(f"{where}: cri-trace version {version!r} is not supported (this reader knows {VERSION})")
    if "node" in obj and not isinstance(obj["node"], dict):
        raise TraceError(f"{where}: header 'node' is not an object")
    return TraceHeader(obj)


def parse_call(obj: Any, where: str) -> TraceCall:
    try:
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
        if obj.get("format") == FORMAT:
            raise ValueError("a second header (files concatenated?)")
        seq = obj.get("seq")
        if not isinstance(seq, int) or isinstance(seq, bool):
            raise ValueError("'seq' is missing or not an integer")
        start = obj.get("start")
        if not isinstance(start, (int, float)) or isinstance(start, bool):
            raise ValueError("'start' is missing or not a number")
        duration = obj.get("duration_ms", 0.0)
        if not isinstance(duration, (int, float)) or isinstance(duration, bool):
            raise ValueError("'duration_ms' is not a number")
        method = obj.get("method")
        if not isinstance(method, str) or not method.startswith("/"):
            raise ValueError("'method' is missing or not a gRPC method path")
        request = _unb64(obj.get("request"), "'request'")
        forwarded = None
        if obj.get("forwarded") is not None:
            forwarded = _unb64(obj["forwarded"], "'forwarded'")
        raw_responses = obj.get("responses")
        if not isinstance(raw_responses, list):
            raise ValueError("'responses' is missing or not a list")
        responses = [_unb64(r, f"'responses'[{i}]") for i, r in enumerate(raw_responses)]
        code = obj.get("code")
        if not isinstance(code, str) or not code:
            raise ValueError("'code' is missing or not a string")
        details = obj.get("details", "")
        if not isinstance(details, str):
            raise ValueError("'details' is not a string")
    except ValueError as e:
        raise TraceError(f"{where}: {e}") from None
    return TraceCall(
        seq=seq,
        start=float(start),
        duration_ms=float(duration),
        method=method,
        request=request,
        forwarded=forwarded,
        responses=responses,
        code=code,
        details=details,
        truncated=obj.get("truncated") is True,
    )


def iter_lines(stream: TextIO) -> Iterator[tuple[int, Any, bool]]:
    """(line number, parsed JSON or the exception, is-last) for each non-blank line."""
    pending: tuple[int, str] | None = None
    for lineno, text in enumerate(stream, 1):
        if not text.strip():
            continue
        if pending is not None:
            yield _decode_json(*pending) + (False,)
        pending = (lineno, text)
    if pending is not None:
        yield _decode_json(*pending) + (True,)


def _decode_json(lineno: int, text: str) -> tuple[int, Any]:
    try:
        return lineno, json.loads(text)
    except ValueError as e:
        return lineno, e


def read_trace_stream(stream: TextIO, name: str = "<trace>") -> Trace:
    header: TraceHeader | None = None
    calls: list[TraceCall] = []
    problems: list[str] = []
    for lineno, obj, last in iter_lines(stream):
        where = f"{name}:{lineno}"
        if isinstance(obj, Exception):
            if last and header is not None:
                problems.append(f"{where}: last line is not complete JSON (recorder killed mid-write?); skipped")
                continue
            raise TraceError(f"{where}: not JSON ({obj})")
        if header is None:
            header = parse_header(obj, where)
            continue
        calls.append(parse_call(obj, where))
    if header is None:
        raise TraceError(f"{name}: empty file, no cri-trace header")
    return Trace(header=header, calls=calls, path=name, problems=problems)


def open_text(path: str) -> TextIO:
    """A trace file opened for reading as UTF-8 text: ``.gz`` and ``.xz`` files are
    decompressed as they are read, anything else is read as it is."""
    name = str(path)
    if name.endswith(".gz"):
        return gzip.open(name, "rt", encoding="utf-8")
    if name.endswith(".xz"):
        return lzma.open(name, "rt", encoding="utf-8")
    return open(name, encoding="utf-8")


def trace_stem(path: str) -> str:
    """A trace file's name without its directory and suffix:
    ``.../kubelet-1.23-cgroupfs-memqos-off.jsonl.xz`` -> ``kubelet-1.23-cgroupfs-memqos-off``."""
    name = str(path).rsplit("/", 1)[-1]
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def read_trace(path: str) -> Trace:
    try:
        with open_text(path) as f:
            return read_trace_stream(f, str(path))
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text ({e})") from None
    except (gzip.BadGzipFile, lzma.LZMAError, EOFError) as e:
        raise TraceError(f"{path}: not a readable compressed file ({e})") from None
    except OSError as e:
        raise TraceError(f"{path}: {e.strerror or e}") from None


def write_trace(path: str, header: dict[str, Any], calls: list[TraceCall]) -> None:
    """A whole trace at once (tests, tools), as a new file: an existing one is never overwritten
    (FileExistsError). The recorder streams instead."""
    with open(path, "x", encoding="utf-8") as f:
        f.write(json.dumps(header, default=str) + "\n")
        for call in calls:
            f.write(call.to_line())
