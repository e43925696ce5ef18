"""Outbox: frames leave in order; queued results of one request leave as one frame."""

from __future__ import annotations

import asyncio

from mlxcel_plugin.link.protocol.frames import Cancel, Frame, FrameType, Result
from mlxcel_plugin.nodes.outbox import Outbox


class RecordingLink:
    """Frames in the order a link would write them; its writer runs a loop turn later."""

    closed = False
    peer_node_id = "router"

    def __init__(self) -> None:
        self.sent: list[Frame] = []
        self.unwritten = 0  # queued on the link, its writer has not run yet
        self.gate: asyncio.Event | None = None  # when set: send() waits for it (a full queue)

    @property
    def idle(self) -> bool:
        return not self.unwritten

    def try_send(self, frame: Frame) -> bool:
        self.sent.append(frame)
        self.unwritten += 1
        asyncio.get_running_loop().call_soon(self._written)
        return True

    async def send(self, frame: Frame) -> None:
        if self.gate is not None:
            await self.gate.wait()
        self.try_send(frame)

    def _written(self) -> None:
        self.unwritten -= 1


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
    # The first goes at once (the link was idle); the rest queue behind it and merge.
    assert sent(link) == [Result("a", 1, [10], None, 2), Result("b", 1, [20, 21], None, 3),
                          Result("a", 2, [11], "length", 3)]


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


def test_a_frame_for_an_idle_link_is_on_the_link_before_the_caller_returns():
    async def main():
        link = RecordingLink()
        outbox = Outbox(link)  # type: ignore[arg-type]
        outbox.put_result(Result("a", 0, [10], None, 1))
        assert sent(link) == [Result("a", 0, [10], None, 1)]  # no loop turn needed
        outbox.close()

    asyncio.run(main())


def test_nothing_overtakes_a_frame_the_outbox_task_is_still_handing_over():
    async def main():
        link = RecordingLink()
        outbox = Outbox(link)  # type: ignore[arg-type]
        link.gate = asyncio.Event()  # the link's queue is full: send() waits
        outbox.put_result(Result("a", 1, [10], None, 2))  # direct: try_send ignores the gate
        outbox.put_result(Result("b", 1, [20], None, 2))  # queued: the link is busy
        await asyncio.sleep(0.01)  # the task now waits in send() with b's frame
        assert link.idle
        outbox.put_result(Result("c", 1, [30], None, 2))  # must wait behind b
        link.gate.set()
        await outbox.flush(1.0)
        outbox.close()
        return link

    link = asyncio.run(main())
    assert [r.request_id for r in sent(link)] == ["a", "b", "c"]
