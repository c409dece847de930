"""Run a transport on an event loop of its own, in a thread (``serve`` runs the relay on uvloop
this way: its per-call cost is mostly event-loop and syscall work, and uvloop cuts the loop's
share, whatever loop the rest of the shim runs on).

Same interface as the wrapped proxy (start, stop, wait_for_termination, attributes); the hooks
are called on the transport's thread, one call at a time, as they would be on a single loop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any, Awaitable, Callable

log = logging.getLogger(__name__)


def host_loop(loop: asyncio.AbstractEventLoop, start: Callable[[], Awaitable[Any]],
              ready: concurrent.futures.Future) -> None:
    """Run ``loop`` in the calling thread as its event loop: first ``start()``, whose result or
    exception goes to ``ready`` (on an exception the loop is closed and this returns), then until
    the loop is stopped; then its async generators are shut down and it is closed."""
    asyncio.set_event_loop(loop)
    try:
        result = loop.run_until_complete(start())
    except BaseException as e:  # noqa: BLE001 - reported through ready
        ready.set_exception(e)
        loop.close()
        return
    ready.set_result(result)
    try:
        loop.run_forever()
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


def uvloop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """``uvloop.new_event_loop`` when uvloop is installed, else None."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


class ThreadedProxy:
    def __init__(self, proxy: Any, loop_factory: Callable[[], asyncio.AbstractEventLoop],
                 name: str = "cri-transport") -> None:
        self._proxy = proxy
        self._factory = loop_factory
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._done: asyncio.Event | None = None  # on the caller's loop
        self._started = False  # the wrapped proxy's start() returned: its loop runs until stop()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._proxy, name)

    @property
    def alive(self) -> bool:
        """The loop's thread runs (False before start and once it ended)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def proxy(self) -> Any:
        return self._proxy

    async def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("start() called twice")
        ready: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            self._loop = self._factory()
            host_loop(self._loop, self._proxy.start, ready)

        self._done = asyncio.Event()
        self._thread = threading.Thread(target=run, name=self._name, daemon=True)
        self._thread.start()
        await asyncio.wrap_future(ready)
        self._started = True

    def _on_loop(self, coro) -> asyncio.Future:
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def stop(self, grace: float | None = None) -> None:
        thread, loop = self._thread, self._loop
        if not self._started:  # never started, or its start failed: that loop is closed or closing
            if thread is not None:
                await asyncio.get_running_loop().run_in_executor(None, thread.join, 10.0)
            return
        if thread is None or loop is None or not thread.is_alive():
            return
        try:
            await self._on_loop(self._proxy.stop(grace))
        finally:
            loop.call_soon_threadsafe(loop.stop)
            await asyncio.get_running_loop().run_in_executor(None, thread.join, 10.0)
            self._done.set()

    async def wait_for_termination(self) -> None:
        if self._done is None:
            raise RuntimeError("not started")
        await self._done.wait()
