"""Losing a link never waits on the peer: ``abort`` and ``wait_closed`` with a hung peer.

The peer serves on its own event loop in a thread; blocking that loop is a hung
process as far as the link can tell (the kernel still holds the socket open).
"""

import asyncio
import threading
import time

import pytest

from mlxcel_plugin.link import LinkConfig, dial_link, serve_links

SECRET = bytes(range(32))
HANG_S = 4.0  # longer than any deadline below: a wait on the peer would show
pytestmark = pytest.mark.timeout(30)


class ThreadPeer:
    """A link listener on its own loop, in a thread, that can be made to hang."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.address = ""
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(serve_links(
            "127.0.0.1:0", SECRET, "decode", "hung", {"router"}, self._serve))
        self.address = f"127.0.0.1:{self.server.port}"
        self.ready.set()
        self.loop.run_forever()

    async def _serve(self, link) -> None:
        await link.wait_closed()

    def hang(self, seconds: float) -> None:
        self.loop.call_soon_threadsafe(time.sleep, seconds)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(HANG_S + 5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(HANG_S + 5)


def test_abort_and_wait_closed_do_not_wait_for_a_hung_peer():
    peer = ThreadPeer()
    close_timeout = LinkConfig(close_timeout_s=HANG_S, bulk=False)

    async def main():
        link = await dial_link(peer.address, SECRET, "router", "r", config=close_timeout)
        peer.hang(HANG_S)
        await asyncio.sleep(0.1)
        async with asyncio.timeout(HANG_S / 2):
            await link.abort()
            await link.wait_closed()
        assert link.closed
        await link.abort()  # idempotent

    try:
        asyncio.run(main())
    finally:
        peer.stop()


def test_close_lets_waiters_go_before_the_close_handshake_ends():
    peer = ThreadPeer()
    close_timeout = LinkConfig(close_timeout_s=HANG_S, bulk=False)

    async def main():
        link = await dial_link(peer.address, SECRET, "router", "r", config=close_timeout)
        peer.hang(HANG_S)
        await asyncio.sleep(0.1)
        closing = asyncio.create_task(link.close(flush=False))
        async with asyncio.timeout(HANG_S / 2):
            await link.wait_closed()  # the handshake with the hung peer is still pending
        assert not closing.done()
        await closing

    try:
        asyncio.run(main())
    finally:
        peer.stop()
