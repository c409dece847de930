"""`scripts/call-walk`: the modules a held CreateContainer passes on its way upstream.

A newcomer reads the request path by following calls from one module into the next. This tool
counts that walk on the real code: a relay (``RelayProxy``) with the hooks as ``serve`` builds
them, in front of a small gRPC runtime, on one event loop; a blocking client in another thread
sends a Burstable CreateContainer. A profiler on the loop's thread records every Python call
into a module of ``shim/`` from the relay's ``data_received`` for the kubelet's bytes until that
call returns (the rewritten bytes are then written upstream), over every chunk the request came
in. Generated protobuf modules are left out; consecutive calls inside one module are one visit.

Counted: every call from a function of one shim module into a function of another (a move; the
caller is the nearest shim frame up the stack, so a call through the standard library or C code
counts from the shim module that made it); a move into a module visited before is a return to a
module already left (a callback into the caller, two halves of one class calling each other, a
generator in another module resumed again). Calls inside one module are not moves. Reported:
the moves in order, the distinct modules, the moves and the returns. ``--hook-as-one`` counts the
rewrite hook (``container/rewriter.py`` and the policy code it calls, outside ``transport/``) as
one module, to read the transport's part on its own.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIM = str(ROOT / "shim") + os.sep
METHOD = "/runtime.v1.RuntimeService/CreateContainer"


def _module(filename: str) -> str | None:
    if not filename.startswith(SHIM) or filename.endswith("_pb2.py") or filename.endswith("_pb2_grpc.py"):
        return None
    return filename[len(str(ROOT)) + 1:]


HOOK = "shim/container/rewriter.py"


def _hook_module(m: str) -> str:
    return m if m.startswith("shim/transport/") else HOOK


def summarize(moves: list, hook_as_one: bool = False) -> dict:
    """The walk from its moves (caller module, called module), the first one (None, start)."""
    walk: list[str] = []
    returns: list[int] = []
    seen: set[str] = set()
    for caller, m in moves:
        if hook_as_one:
            caller = caller and _hook_module(caller)
            m = _hook_module(m)
            if caller == m:
                continue
        if walk and walk[-1] == m:
            continue
        if m in seen:
            returns.append(len(walk))
        walk.append(m)
        seen.add(m)
    return {"walk": walk, "modules": len(seen), "moves": max(0, len(walk) - 1), "returns": len(returns),
            "returned_at": returns}


def walk(hook_as_one: bool = False) -> dict:
    from shim.app.service import build_container_qos
    from shim.container.chain import build_request_hooks
    from shim.cri import pb
    from shim.cri.methods import CRI_METHODS
    from shim.decision import Policy
    from shim.node.facts import load_kubelet_config, node_facts
    from shim.tools import kubelet_requests as kr
    from shim.tools.grpc_server import GrpcServer
    from shim.transport.relay.aio import RelayProxy
    from shim.transport.unary_client import UnaryClient

    mib = 1 << 20
    node = node_facts(16 * 1024 * mib, load_kubelet_config(None), page_size=4096, allocatable=None, factor="auto")
    hooks = build_request_hooks(build_container_qos(node, Policy("Hard"), lambda record: None))
    sandbox = kr.sandbox_config("web", "1f0c2a9e-0000-4000-8000-000000000005", "burstable")
    request = kr.create_container("sb1", sandbox, "app", "burstable", request=128 * mib,
                                  limit=256 * mib).SerializeToString()
    answer = pb.CreateContainerResponse(container_id="c" * 64).SerializeToString()
    seen_by_runtime: list[bytes] = []

    async def handler(path, headers, messages):
        seen_by_runtime.extend(messages)
        if path == METHOD:
            return [answer], "OK", ""
        return [pb.VersionResponse(version="0.1.0").SerializeToString()], "OK", ""

    state = {"armed": False, "active": None, "moves": [], "rewritten": False, "done": False}
    relay_file = str(ROOT / "shim" / "transport" / "relay" / "aio.py")

    def caller_module(frame) -> str | None:
        f = frame.f_back
        while f is not None:
            m = _module(f.f_code.co_filename)
            if m is not None:
                return m
            f = f.f_back
        return None

    def profile(frame, event, arg):
        if state["done"]:
            return
        code = frame.f_code
        if event == "return":
            if frame is state["active"]:
                state["active"] = None
                if state["rewritten"]:
                    state["done"] = True
            return
        if event != "call":
            return
        if state["active"] is None:
            if state["armed"] and code.co_name == "data_received" and code.co_filename == relay_file \
                    and type(frame.f_locals.get("self")).__name__ == "_ClientSide":
                state["active"] = frame
                if not state["moves"]:
                    state["moves"].append((None, _module(code.co_filename)))
            return
        m = _module(code.co_filename)
        if m is None:
            return
        if m == HOOK:
            state["rewritten"] = True
        caller = caller_module(frame)
        if caller is not None and caller != m:
            state["moves"].append((caller, m))

    async def main() -> dict:
        with tempfile.TemporaryDirectory(prefix="mqwalk-") as d:
            runtime = GrpcServer(handler)
            await runtime.start(os.path.join(d, "runtime.sock"))
            relay = RelayProxy(os.path.join(d, "shim.sock"), "unix://" + runtime.path, hooks, methods=CRI_METHODS)
            await relay.start()
            client = UnaryClient("unix://" + relay.listen_path)
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(None, client.call, "/runtime.v1.RuntimeService/Version", b"", 5.0)
                state["armed"] = True
                sys.setprofile(profile)
                try:
                    await loop.run_in_executor(None, client.call, METHOD, request, 5.0)
                finally:
                    sys.setprofile(None)
            finally:
                client.close()
                await relay.stop()
                await runtime.stop()
        if not state["done"]:
            raise RuntimeError("the CreateContainer was not seen rewritten on the relay's thread")
        if request in seen_by_runtime:
            raise RuntimeError("the runtime got the kubelet's bytes unchanged: no rewrite happened")
        return summarize(state["moves"], hook_as_one)

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/call-walk", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--hook-as-one", action="store_true",
                   help="count the rewrite hook and the policy code it calls as one module")
    args = p.parse_args(argv)
    result = walk(args.hook_as_one)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print("memqos-shim call-walk: a held CreateContainer, request side (data_received until its return)")
    for i, m in enumerate(result["walk"]):
        print(f"{i:3d}  {m}{'   <- return' if i in result['returned_at'] else ''}")
    print(f"modules {result['modules']}, moves {result['moves']}, returns to a module already left {result['returns']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
