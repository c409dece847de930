"""The soak's runtime: ``memqos_dev.testing.fake_runtime`` served as its ``__main__`` serves it, but
without the per-call log (``FakeRuntime.calls`` and the received request lists grow with every
call; the soak measures the shim's memory, not the fake's). Prints the same "listening" line."""
from __future__ import annotations

import asyncio
import signal

from memqos_dev.testing.fake_runtime.runtime import FakeRuntime
from memqos_dev.testing.fake_runtime.server import serve_fake_runtime


class UnloggedRuntime(FakeRuntime):
    def record_call(self, method, request):
        call = super().record_call(method, request)
        with self.lock:
            self.calls.clear()
            self.received_create_requests.clear()
            self.received_update_requests.clear()
        return call


def run_upstream(listen: str) -> int:
    async def main() -> None:
        server, _ = await serve_fake_runtime(listen, UnloggedRuntime())
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(f"fake-runtime listening on unix://{listen}", flush=True)
        await stop.wait()
        await server.stop(0)

    asyncio.run(main())
    return 0
