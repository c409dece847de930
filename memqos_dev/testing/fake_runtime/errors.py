"""How the fake runtime fails a call (containerd's gRPC statuses and message texts) and finds
records by id, prefix or label, as containerd's stores and list filters do.

containerd turns Go errors into gRPC statuses with ``errdefs.ToGRPC``: an error wrapping
``errdefs.ErrNotFound`` becomes NOT_FOUND, anything unrecognised UNKNOWN; the status message
is the whole wrapped error text.
"""
from __future__ import annotations

import json
from typing import Iterable, Mapping

import grpc

NOT_FOUND = grpc.StatusCode.NOT_FOUND
UNKNOWN = grpc.StatusCode.UNKNOWN


class CriError(Exception):
    """A CRI call failing with a gRPC status, as containerd's errdefs.ToGRPC would return it."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def quote(s: str) -> str:
    """Go's %q for the strings we meet (ids, names): a double-quoted, escaped string."""
    return json.dumps(s, ensure_ascii=False)


def go_duration(seconds: float) -> str:
    """Go's time.Duration.String() for whole/fractional seconds as they appear in messages."""
    if seconds == int(seconds):
        return f"{int(seconds)}s"
    return f"{seconds:g}s"


class IdLookupError(Exception):
    """An id or prefix that names no record, or several (truncindex), with its status code."""

    def __init__(self, code: grpc.StatusCode, text: str):
        super().__init__(text)
        self.code = code
        self.text = text


def truncindex_get(ids: Iterable[str], key: str) -> str:
    """containerd's truncindex.Get: exact id or unique prefix.

    Empty key -> "prefix can't be empty" (UNKNOWN), no match -> ErrNotFound ("not found",
    NOT_FOUND), several matches -> "Multiple IDs found with provided prefix: <key>" (UNKNOWN).
    """
    if key == "":
        raise IdLookupError(UNKNOWN, "prefix can't be empty")
    ids = list(ids)
    if key in ids:
        return key
    matches = [i for i in ids if i.startswith(key)]
    if not matches:
        raise IdLookupError(NOT_FOUND, "not found")
    if len(matches) > 1:
        raise IdLookupError(UNKNOWN, f"Multiple IDs found with provided prefix: {key}")
    return matches[0]


def filter_id(ids: Iterable[str], key: str) -> str:
    """A list filter's id: the full id it is a unique prefix of, else the key itself (which
    then matches nothing) -- containerd filters lists this way, it never fails them."""
    try:
        return truncindex_get(ids, key)
    except IdLookupError:
        return key


def labels_match(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    """A list filter's label_selector: every key=value pair must be among the labels."""
    return all(labels.get(k) == v for k, v in selector.items())
