"""The rollout mode: ``enforce`` (the shim acts) or ``observe`` (it decides and audits, and acts
on nothing).

One ``Rollout`` per running shim, shared by everything that would act: the CRI rewriter
(forwards the kubelet's bytes), the NRI handler (answers with empty adjustments), and every
cgroup writer here in ``shim.effects`` (reads, decides what it would write, audits it, and
writes nothing). The hot paths read ``observe``, one attribute; ``set`` replaces it (a single
assignment, from any thread: the SIGHUP reload), so a call sees one mode or the other, never a
mix. Records of what was decided or would have been written in observe carry
``"rollout": "observe"`` (``tag``); the audit's ``mode`` key is the NRI front end's.
"""
from __future__ import annotations

ENFORCE = "enforce"
OBSERVE = "observe"
MODES = (ENFORCE, OBSERVE)


class Rollout:
    __slots__ = ("observe", "switches")

    def __init__(self, mode: str = ENFORCE):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, not {mode!r}")
        self.observe = mode == OBSERVE
        self.switches = 0  # times the mode changed since start (a would-write is audited once per mode spell)

    @property
    def mode(self) -> str:
        return OBSERVE if self.observe else ENFORCE

    def set(self, mode: str) -> bool:
        """Switch to ``mode``; whether it changed."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, not {mode!r}")
        observe = mode == OBSERVE
        if observe == self.observe:
            return False
        self.switches += 1
        self.observe = observe
        return True


def tag(record: dict, observe: bool) -> dict:
    """``record`` with ``"rollout": "observe"`` when it was made in observe."""
    if observe:
        record["rollout"] = OBSERVE
    return record
