"""python -m memqos_dev.testing.fake_runtime --listen PATH [--cgroup-driver cgroupfs|systemd] ...

Runs the fake CRI runtime in the foreground until SIGTERM or SIGINT, then stops the server,
removes the socket and exits 0. Prints one line "fake-runtime listening on unix:///PATH" to
stdout once the socket accepts connections (demo and benchmark scripts wait for it).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import grpc

from memqos_dev.testing.fake_runtime.records import CGROUPFS, SYSTEMD
from memqos_dev.testing.fake_runtime.runtime import FakeRuntime
from memqos_dev.testing.fake_runtime.server import DEFAULT_MAX_MESSAGE_BYTES, remove_stale_socket, serve_fake_runtime, socket_path

log = logging.getLogger("memqos_dev.testing.fake_runtime")


def _parse_delay(text: str) -> tuple[str, float]:
    name, sep, seconds = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected METHOD=SECONDS, got {text!r}")
    try:
        return name, float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad seconds in {text!r}") from None


def _parse_fail(text: str) -> tuple[str, tuple[grpc.StatusCode, str]]:
    name, sep, rest = text.partition("=")
    code_name, _, details = rest.partition(":")
    try:
        code = grpc.StatusCode[code_name.upper()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected METHOD=CODE[:details], got {text!r}") from None
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected METHOD=CODE[:details], got {text!r}")
    return name, (code, details)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m memqos_dev.testing.fake_runtime", description=__doc__.split("\n\n")[1])
    p.add_argument("--listen", required=True, help="unix socket path (or unix:///path) to serve on")
    p.add_argument("--cgroup-driver", choices=(CGROUPFS, SYSTEMD), default=CGROUPFS)
    p.add_argument("--cgroup-root", default=None, metavar="DIR",
                   help="a cgroup v2 tree (real files) where started containers get their cgroup like runc "
                        "makes it (<parent>/<id>, or cri-containerd-<id>.scope in the expanded slice with systemd)")
    p.add_argument("--delay", action="append", type=_parse_delay, default=[], metavar="METHOD=SECONDS",
                   help="delay a method, e.g. PullImage=2 (repeatable)")
    p.add_argument("--fail", action="append", type=_parse_fail, default=[], metavar="METHOD=CODE[:details]",
                   help="make a method fail, e.g. CreateContainer=UNAVAILABLE:busy (repeatable)")
    p.add_argument("--idempotent-stop", action="store_true",
                   help="StopContainer/StopPodSandbox of unknown ids answer OK (containerd after mid-2024)")
    p.add_argument("--strict-images", action="store_true",
                   help="CreateContainer of an image not in the store fails NOT_FOUND like containerd")
    p.add_argument("--network-not-ready", action="store_true", help="report NetworkReady=false")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    p.add_argument("-v", "--verbose", action="store_true", help="log every call")
    return p


async def _run(args: argparse.Namespace) -> int:
    runtime = FakeRuntime(
        cgroup_driver=args.cgroup_driver,
        delays=dict(args.delay),
        fail=dict(args.fail),
        idempotent_stop=args.idempotent_stop,
        strict_images=args.strict_images,
        network_ready=not args.network_not_ready,
        cgroup_root=args.cgroup_root,
    )
    path = socket_path(args.listen)
    server, _ = await serve_fake_runtime(path, runtime, max_message_bytes=args.max_message_bytes)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"fake-runtime listening on unix://{path}", flush=True)
    try:
        if args.verbose:
            seen = 0
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), 0.2)
                except asyncio.TimeoutError:
                    pass
                with runtime.lock:
                    new = runtime.calls[seen:]
                # log finished calls in arrival order; an unfinished one waits for the next round
                for c in new:
                    if not c.code:
                        break
                    log.info("%s %s %s", c.name, c.code, c.details)
                    seen += 1
        else:
            await stop.wait()
    finally:
        await server.stop(1.0)
        try:
            remove_stale_socket(path)
        except OSError:
            pass
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    return asyncio.run(_run(args))


if __name__ == "__main__":
    raise SystemExit(main())
