"""ThreadedProxy (shim.transport.loop_thread): a transport whose start fails can be stopped."""
import asyncio
import threading

import pytest

from shim.transport.loop_thread import ThreadedProxy


class _FailingProxy:
    async def start(self):
        raise OSError("the socket is taken")

    async def stop(self, grace=None):
        raise AssertionError("stop() of a transport that never started")


def test_stop_after_a_failed_start_returns():
    """The start's exception reaches the caller while the transport's thread is still closing
    its loop; stop() then must not hand work to that loop (it never runs again)."""
    closing, release = threading.Event(), threading.Event()

    class _SlowToClose(asyncio.SelectorEventLoop):
        def close(self):
            closing.set()
            release.wait(30)
            super().close()

    async def main():
        proxy = ThreadedProxy(_FailingProxy(), _SlowToClose)
        with pytest.raises(OSError, match="taken"):
            await proxy.start()
        assert await asyncio.to_thread(closing.wait, 30)
        stopping = asyncio.ensure_future(proxy.stop(grace=1))
        await asyncio.sleep(0)
        release.set()
        await asyncio.wait_for(stopping, 30)  # a guard against a hang, not a timing check
        assert not proxy.alive

    asyncio.run(main())
