"""A heartbeat file for exec probes: the running front end says it is alive (and whether it is
connected), `memqos-shim health` reads it.

The DaemonSet's liveness and readiness probes run ``memqos-shim health`` in the plugin's
container. An httpGet probe would only show that the metrics thread answers, not that the
event loop runs or that the plugin is registered with the runtime, and it would need the
metrics (which name pods and containers) on the pod's network address. The file is small JSON,
replaced atomically (written under a new name of its own, then renamed), so a reader never
sees half of it; only a heartbeat file is replaced, and only the one it wrote is removed when
the front end stops (anything else at the path is left alone and the beat fails):

    {"pid": 1234, "time": 1700000000.5, "state": "registered", "since": 1699999990.0}

``time`` is refreshed by the event loop every ``interval`` seconds, so a stale ``time`` means
the loop is stuck or the process is gone (liveness). ``state`` is what the front end reports:
``registered`` when the runtime has accepted the plugin (readiness), anything else otherwise
(``connecting``, ``stopping``). The probe's side (``check``, ``main``) is stdlib only, no shim
imports: the probe starts a fresh interpreter every period and counts against the container's
memory limit. The writer replaces the file with shim.effects.files.replace_file.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Callable

READY_STATE = "registered"
HEARTBEAT_KEYS = ("time", "state")  # a JSON object with these is a heartbeat file, the only kind replaced
MAX_BYTES = 4096  # a heartbeat file is read (by the probe, and before it is replaced) up to this
STATE_POLL = 0.5  # seconds between looks at the state between two heartbeats


class Heartbeat:
    """Writes the heartbeat file. ``beat(state)`` once at start; ``run(state_fn)`` is a task that
    beats every ``interval`` seconds (off the loop) until cancelled, then removes the file."""

    def __init__(self, path: str, interval: float = 5.0, clock: Callable[[], float] = time.time):
        self.path = path
        self.interval = interval
        self.clock = clock
        self.state: str | None = None
        self.since = 0.0
        self.failures = 0  # writes that failed (the probe will then fail: that is the report)
        self._written: tuple[int, int] | None = None  # (st_dev, st_ino) of the file last written

    def beat(self, state: str) -> bool:
        now = self.clock()
        if state != self.state:
            self.state, self.since = state, now
        doc = {"pid": os.getpid(), "time": now, "state": state, "since": self.since}
        try:
            from shim.effects.files import replace_file  # the writer's only: the probe stays stdlib only

            # the probe may run as another user: 0644; a heartbeat is not worth an fsync
            replace_file(self.path, json.dumps(doc).encode(), keys=HEARTBEAT_KEYS, max_bytes=MAX_BYTES,
                         mode=0o644, fsync=False)
            st = os.lstat(self.path)
            self._written = (st.st_dev, st.st_ino)
            return True
        except OSError:
            self.failures += 1
            return False

    async def run(self, state_fn: Callable[[], str]) -> None:
        """Beat every ``interval`` seconds, and at once when the state changes (looked at every
        ``STATE_POLL`` seconds), so a readiness probe sees a registration within that; the file is
        written in the loop's default executor, so a slow file system never holds up the loop (the
        NRI plugin answers the runtime there)."""
        loop = asyncio.get_running_loop()
        writing = None
        try:
            while True:
                state = state_fn()
                writing = loop.run_in_executor(None, self.beat, state)
                await writing
                due = loop.time() + self.interval
                while loop.time() < due and state_fn() == state:
                    await asyncio.sleep(min(STATE_POLL, max(0.0, due - loop.time())))
        finally:
            self.clear()
            if writing is not None and not writing.done():  # a write still under way: removed after it
                writing.add_done_callback(lambda _f: self.clear())

    def clear(self) -> None:
        """Remove the file, if it is still the one this heartbeat wrote."""
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._written:
                os.unlink(self.path)
        except OSError:
            pass


def check(path: str, max_age: float, ready: bool = False, now: float | None = None) -> tuple[bool, str]:
    """(healthy, one line why). Liveness: the file exists, parses and is at most ``max_age``
    seconds old. With ``ready``: also in the registered state."""
    now = time.time() if now is None else now
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(MAX_BYTES))
        t, state = float(doc["time"]), str(doc["state"])
    except FileNotFoundError:
        return False, f"no heartbeat at {path}: the front end has not started (or has stopped)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return False, f"unreadable heartbeat {path}: {e.__class__.__name__}: {e}"
    age = now - t
    if age > max_age:
        return False, f"heartbeat {age:.0f} s old (> {max_age:g} s): the event loop is stuck or the process is gone"
    if ready and state != READY_STATE:
        return False, f"state {state!r} for {now - float(doc.get('since', t)):.0f} s: not registered with the runtime"
    return True, f"state {state!r}, heartbeat {age:.1f} s old"


def main(argv: list[str] | None = None) -> int:
    """``python -m shim.evidence.health --file F [--max-age S] [--ready]`` (what ``memqos-shim
    health`` runs)."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="memqos-shim health", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    return run_check(args, sys.stdout)


def add_arguments(p) -> None:
    p.add_argument("--file", required=True, metavar="PATH", help="the heartbeat file (the health-file setting)")
    p.add_argument("--max-age", type=float, default=30.0, metavar="SECONDS",
                   help="older than this is unhealthy (default 30)")
    p.add_argument("--ready", action="store_true", help="also require the registered state (readiness)")


def run_check(args, out) -> int:
    ok, why = check(args.file, args.max_age, args.ready)
    out.write(f"{'ok' if ok else 'unhealthy'}: {why}\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
