"""Outbox: frames leave in order; queued results of one request leave as one frame."""

from __future__ import annotations

import asyncio

from mlxcel_plugin.frames import Cancel, Frame, FrameType, Result
from mlxcel_plugin.nodes.outbox import Outbox


class RecordingLink:
    closed = False
    peer_node_id = "router"

    def __init__(self) -> None:
        self.sent: list[Frame] = []

    async def send(self, frame: Frame) -> None:
        self.sent.append(frame)


def sent(link: RecordingLink) -> list[Result | str]:
    return [Result.from_frame(f) if f.type is FrameType.RESULT else f.type.name
            for f in link.sent]


async def drained(put) -> RecordingLink:
    link = RecordingLink()
    outbox = Outbox(link)  # type: ignore[arg-type]
    put(outbox)
    await outbox.flush(1.0)
    outbox.close()
    return link


def test_queued_results_of_a_request_go_as_one_frame():
    def put(outbox: Outbox) -> None:
        outbox.put_result(Result("a", 1, [10], None, 2))
        outbox.put_result(Result("b", 1, [20], None, 2))
        outbox.put_result(Result("a", 2, [11], None, 3))
        outbox.put_result(Result("a", 3, [], "length", 3))
        outbox.put_result(Result("b", 2, [21], None, 3))

    link = asyncio.run(drained(put))
    assert sent(link) == [Result("a", 1, [10, 11], "length", 3), Result("b", 1, [20, 21], None, 3)]


def test_results_do_not_merge_across_a_gap_an_end_or_another_frame():
    def put(outbox: Outbox) -> None:
        outbox.put_result(Result("a", 1, [10], None, 2))
        outbox.put_result(Result("a", 3, [12], None, 4))  # gap: not a continuation
        outbox.put(Cancel("x").to_frame())
        outbox.put_result(Result("a", 4, [13], "stop", 5))  # must not overtake the CANCEL
        outbox.put_result(Result("a", 5, [14], None, 6))  # after the end: its own frame

    link = asyncio.run(drained(put))
    assert sent(link) == [Result("a", 1, [10], None, 2), Result("a", 3, [12], None, 4), "CANCEL",
                          Result("a", 4, [13], "stop", 5), Result("a", 5, [14], None, 6)]
