"""JSON the way containerd's Go code writes it.

containerd's verbose ``info`` maps hold ``encoding/json`` output of Go structs that embed
CRI messages (gogo-protobuf structs). That differs from protobuf's canonical JSON mapping:

* keys are the proto field names as written in the .proto (``log_directory``,
  ``CDI_devices``), from the ``json:"name,omitempty"`` struct tags;
* zero scalars, empty repeated fields and empty maps are omitted (``omitempty``), while a
  set sub-message is kept even when empty (a non-nil pointer marshals as ``{}``);
* enums and 64-bit integers are plain JSON numbers, bytes are standard base64;
* map keys are sorted, output is compact, and ``<``, ``>``, ``&`` are escaped as
  ``\\u003c``, ``\\u003e``, ``\\u0026`` (Go's HTML-safe default).
"""
from __future__ import annotations

import base64
import json
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

_TYPE_BYTES = FieldDescriptor.TYPE_BYTES
_TYPE_MESSAGE = FieldDescriptor.TYPE_MESSAGE
_TYPE_ENUM = FieldDescriptor.TYPE_ENUM


def _is_repeated(field: FieldDescriptor) -> bool:
    # FieldDescriptor.label is deprecated in recent protobuf releases.
    is_repeated = getattr(field, "is_repeated", None)
    if is_repeated is not None:
        return bool(is_repeated)
    return field.label == FieldDescriptor.LABEL_REPEATED


def _scalar(field: FieldDescriptor, value: Any) -> Any:
    if field.type == _TYPE_BYTES:
        return base64.b64encode(value).decode("ascii")
    if field.type == _TYPE_ENUM:
        return int(value)
    return value


def go_struct(msg: Message) -> dict[str, Any]:
    """The dict Go's encoding/json would produce for the gogo struct of ``msg``."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            if not value:
                continue
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {
                str(k): (go_struct(v) if value_field.type == _TYPE_MESSAGE else _scalar(value_field, v))
                for k, v in sorted(value.items())
            }
        elif _is_repeated(field):
            if not value:
                continue
            if field.type == _TYPE_MESSAGE:
                out[field.name] = [go_struct(v) for v in value]
            else:
                out[field.name] = [_scalar(field, v) for v in value]
        elif field.type == _TYPE_MESSAGE:
            if msg.HasField(field.name):
                out[field.name] = go_struct(value)
        else:
            if value in (0, "", b"", False, 0.0):
                continue
            out[field.name] = _scalar(field, value)
    return out


def dumps(obj: Any) -> str:
    """Compact JSON with Go's HTML escaping; messages inside are converted with go_struct."""

    def default(o: Any) -> Any:
        if isinstance(o, Message):
            return go_struct(o)
        raise TypeError(f"not JSON serializable: {type(o).__name__}")

    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, default=default)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
