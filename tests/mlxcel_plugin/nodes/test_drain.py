"""A node's drain: the request gate, the notice on router links, the wait, the signals."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from mlxcel_plugin.errors import AtCapacityError, NodeDrainingError
from mlxcel_plugin.link import LinkClosed
from mlxcel_plugin.link.protocol.frames import ErrorFrame, FrameType, Request
from mlxcel_plugin.nodes.drain import NodeDrain, StopSignals, wait_drained
from mlxcel_plugin.nodes.requests import dispatch_router_frame

pytestmark = pytest.mark.timeout(30)


class FakeLink:
    def __init__(self, closed: bool = False):
        self.sent: list = []
        self.closed = closed
        self.peer_node_id = "router-1"

    async def send(self, frame) -> None:
        if self.closed:
            raise LinkClosed("closed")
        self.sent.append(frame)


def test_a_draining_node_refuses_requests_with_at_capacity_so_routers_replace_them():
    drain = NodeDrain("d1")
    request = Request("r1", [1, 2, 3], claim=True)
    taken, replies = [], []

    def dispatch() -> None:
        dispatch_router_frame(request.to_frame(), taken.append, lambda rid: None,
                              replies.append, drain.admit)

    dispatch()
    assert [r.request_id for r in taken] == ["r1"] and replies == []

    async def begin() -> None:
        drain.begin()

    asyncio.run(begin())
    with pytest.raises(AtCapacityError):
        drain.admit(request)
    dispatch()
    assert len(taken) == 1
    error = ErrorFrame.from_frame(replies[0])
    assert (error.code, error.request_id) == ("at_capacity", "r1")


def test_every_router_link_hears_the_drain_once_even_one_that_joins_later():
    async def main() -> None:
        drain = NodeDrain("d1")
        early, gone = FakeLink(), FakeLink(closed=True)
        drain.add_router(early)
        drain.add_router(gone)  # a closed link is skipped quietly
        drain.begin()
        drain.begin()  # once only
        late = FakeLink()
        drain.add_router(late)
        await asyncio.sleep(0.05)
        for link in (early, late):
            assert len(link.sent) == 1 and link.sent[0].type is FrameType.ERROR
            notice = ErrorFrame.from_frame(link.sent[0])
            assert (notice.code, notice.request_id) == (NodeDrainingError.code, None)

    asyncio.run(main())


def test_wait_drained_returns_when_idle_or_says_what_is_left():
    async def main() -> None:
        work = {"left": 2}

        async def finish_later() -> None:
            await asyncio.sleep(0.1)
            work["left"] = 0

        finishing = asyncio.create_task(finish_later())
        assert await wait_drained(lambda: work["left"], timeout_s=10.0) == 0
        await finishing
        assert await wait_drained(lambda: 3, timeout_s=0.1) == 3
        stop_now = asyncio.Event()
        stop_now.set()
        assert await wait_drained(lambda: 1, timeout_s=10.0, stop_now=stop_now) == 1

    asyncio.run(main())


def test_the_first_signal_drains_and_the_second_stops_now():
    async def main() -> None:
        with StopSignals().installed() as signals:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(signals.drain.wait(), 5)
            assert not signals.stop_now.is_set()
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.wait_for(signals.stop_now.wait(), 5)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers removed

    asyncio.run(main())
