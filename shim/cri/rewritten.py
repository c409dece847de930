"""What the rewrite hook leaves on a call for ``finished`` and the observers: one typed record
in one field of the call (``RpcCall.rewritten``), the only place hook-private data lives on it.
The transport never reads it; ``shim.container.rewriter`` writes it, ``shim.cri.events`` reads
``parsed`` and ``decision``."""
from __future__ import annotations

from typing import Any, Callable

from google.protobuf.message import Message

from shim.decision import Decision


class Rewritten:
    """``parsed``: the request message the rewriter parsed, as the rewrite made it (changed in
    place; None when parsing failed). ``decision``: what it decided (None when it did not
    decide). ``audit``: its audit record, or a callable that builds it in ``finished``.
    ``memo``: what the rewriter remembers once the call succeeded (its own type).
    ``container_id``: the id the runtime gave a created container ("" until the answer)."""

    __slots__ = ("parsed", "decision", "audit", "memo", "container_id")

    def __init__(self, parsed: Message | None, decision: Decision | None,
                 audit: dict | Callable[[], dict] | None, memo: Any = None) -> None:
        self.parsed = parsed
        self.decision = decision
        self.audit = audit
        self.memo = memo
        self.container_id = ""
