"""scripts/soak (memqos_dev/tools/soak/): how it classifies answers, that its expectation of a rewrite
is the shim's, the --probes hook, and one short run with the runtime killed under load."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import types

import pytest

from shim.app.service import build_container_qos
from shim.cri import pb
from shim.cri.methods import CREATE_CONTAINER
from shim.tools.kubelet_requests import create_container, sandbox_config
from memqos_dev.tools.soak import __main__ as soak_main
from memqos_dev.tools.soak.checks import LOST, MANGLED, OK, STALE, UNAVAILABLE, Expect, Tally
from memqos_dev.tools.soak.driver import PODS, Context
from memqos_dev.tools.soak.stack import CAPACITY, Faults, Stack
from shim.transport.hooks import RpcCall


class Conn:
    """Answers each call with the (code, details, bytes) it is given."""

    def __init__(self, answer) -> None:
        self.answer = answer

    def call(self, name, request, timeout):
        return self.answer


@pytest.fixture
def ctx(tmp_path):
    faults = Faults(stack=None, every=0, down=0)
    return Context(target="", cgroot=tmp_path, expect=None, faults=faults, tally=Tally(), calls=10**9,
                   deadline=1.0, grace=2.0, backoff=0.0, end_at=time.monotonic() + 3600)


VERSION = pb.VersionResponse(runtime_name="fake-runtime", runtime_api_version="v1").SerializeToString()


def one(ctx, answer, **kw) -> str:
    before = dict(ctx.tally.counts)
    ctx.rpc(Conn(answer), "Version", pb.VersionRequest(), **kw)
    [cls] = [c for c in ctx.tally.counts if ctx.tally.counts[c] != before[c]]
    return cls


def test_answers_are_classified(ctx):
    assert one(ctx, ("OK", "", VERSION), check=lambda r: []) == OK
    assert one(ctx, ("OK", "", b"\xff\xff\xff"), check=lambda r: []) == MANGLED  # not a VersionResponse
    assert one(ctx, ("OK", "", VERSION), check=lambda r: ["says something else"]) == MANGLED
    assert one(ctx, ("DEADLINE_EXCEEDED", "", None)) == LOST
    assert one(ctx, ("INTERNAL", "boom", None)) == MANGLED
    assert one(ctx, ("CANCELLED", "", None)) == MANGLED
    # UNAVAILABLE only during an outage (and its grace)
    assert one(ctx, ("UNAVAILABLE", "", None)) == MANGLED
    now = time.monotonic()
    ctx.faults.windows.append([now - 1.0, now - 0.5])
    assert one(ctx, ("UNAVAILABLE", "", None)) == UNAVAILABLE  # within grace (2 s) of the restart
    ctx.faults.windows[-1] = [now - 10.0, now - 5.0]
    assert one(ctx, ("UNAVAILABLE", "", None)) == MANGLED
    ctx.faults.windows.append([now, float("inf")])  # down now
    assert one(ctx, ("UNAVAILABLE", "", None)) == UNAVAILABLE
    # NOT_FOUND: of an object made before a restart, or whose removal was asked for
    ctx.faults.epoch = 3
    assert one(ctx, ("NOT_FOUND", "", None), epoch=2) == STALE
    assert one(ctx, ("NOT_FOUND", "", None), epoch=3) == MANGLED
    assert one(ctx, ("NOT_FOUND", "", None), epoch=3, removing="c1") == MANGLED
    ctx.removing.add("c1")
    assert one(ctx, ("NOT_FOUND", "", None), epoch=3, removing="c1") == STALE
    # a content check is not applied to an answer about an object from before a restart
    assert one(ctx, ("OK", "", VERSION), epoch=2, check=lambda r: ["the old object is gone"]) == OK


def test_the_expected_rewrite_is_what_serve_sends():
    """The soak's expectation (node facts read from its files as `serve` reads them, then
    shim.decision) equals the rewriter's output for every container it creates."""
    stack = Stack()
    stack.prepare()
    try:
        expect = Expect(stack)
        rewriter = build_container_qos(expect.node, expect.policy, lambda r: None)
        keys: set[str] = set()
        for k, (qos, requests, containers, _) in enumerate(PODS):
            ann = {"memqos.io/requests": json.dumps(requests)} if requests else None
            sb = sandbox_config(f"p{k}", f"uid-{k}", qos, annotations=ann)
            for name, request, limit, unified in containers:
                req = create_container("s" * 64, sb, name, qos, request=request, limit=limit, unified=unified,
                                       capacity=CAPACITY)
                out = rewriter.rewrite(RpcCall(method=CREATE_CONTAINER, start=0.0, request=req.SerializeToString()))
                got = dict(pb.CreateContainerRequest.FromString(out).config.linux.resources.unified)
                assert got == dict(expect.create(req).unified_after), (qos, name)
                keys |= set(got)
        assert {"memory.min", "memory.high"} <= keys  # the soak's pods are rewritten, not passed through
    finally:
        stack.stop()


def test_probes_are_run_when_the_tree_has_them(monkeypatch, tmp_path, capsys):
    stack = types.SimpleNamespace(shim_sock=tmp_path / "shim.sock", runtime_sock=tmp_path / "rt.sock",
                                  shim=types.SimpleNamespace(pid=4242))
    monkeypatch.setattr(soak_main, "PROBES_MODULE", "soak_test_no_such_probes")
    assert soak_main.run_probes(stack)
    assert "h2 limit probes: not available in this tree" in capsys.readouterr().out
    (tmp_path / "soak_test_probes.py").write_text(
        "seen = []\n"
        "def run_probes(socket, pid, other=None):\n"
        "    seen.append((socket, pid, other))\n"
        "    return [('limit', 'tripped after', '1 MiB')]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(soak_main, "PROBES_MODULE", "soak_test_probes")
    assert soak_main.run_probes(stack)
    import soak_test_probes

    assert soak_test_probes.seen == [(str(tmp_path / "shim.sock"), 4242, None)]
    assert "limit  tripped after  1 MiB" in capsys.readouterr().out


def test_short_soak_with_the_runtime_killed():
    """A few thousand calls with the runtime killed every half second: none lost or mangled.
    (The RSS limit is lifted: a few thousand calls say nothing about growth per 100k.)"""
    proc = subprocess.run(
        [sys.executable, "-m", "memqos_dev.tools.soak", "--calls", "3000", "--warmup", "500", "--kill-every", "0.5",
         "--down", "0.2", "--clients", "2", "--max-growth-mib", "1e9", "--max-seconds", "90"],
        capture_output=True, text=True, timeout=180)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    fields = dict(re.findall(r"^  (\S.*?)\s{2,}(\S.*)$", out, re.M))
    assert fields["lost (no answer in time)"] == "0" and fields["mangled"] == "0"
    assert int(fields["outages (runtime killed)"].split()[0]) >= 1
    assert int(fields["answered as the runtime answered"].split()[0]) > 1000
