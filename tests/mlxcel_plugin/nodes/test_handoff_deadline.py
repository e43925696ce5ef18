"""A prefill node waits for a handoff's ack while its frames keep moving, and gives up once
none moved for ``transfer_timeout_s`` (``PrefillNode._ack_while_moving``)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from mlxcel_plugin.kv_serde import AckHeader
from mlxcel_plugin.nodes.prefill_node import PrefillNode
from mlxcel_plugin.scheduling import PrefillJob, PrefillScheduler, PrefillSchedulerConfig

TIMEOUT_S = 0.3


class Scheduler(PrefillScheduler):
    """The real scheduler, handing off request "r", and the progress it was told of."""

    def __init__(self) -> None:
        super().__init__(PrefillSchedulerConfig(transfer_timeout_s=TIMEOUT_S))
        self.moves: list[float] = []
        self.submit(PrefillJob("r", 10), now=time.monotonic())
        self.next_ready(time.monotonic())
        self.on_prefill_done("r", time.monotonic(), target="decode-0")

    def on_handoff_progress(self, request_id: str, moved_s: float | None) -> float | None:
        if moved_s is not None:
            self.moves.append(moved_s)
        return super().on_handoff_progress(request_id, moved_s)


def node() -> SimpleNamespace:
    transfer = SimpleNamespace(transfer_timeout_s=TIMEOUT_S)
    return SimpleNamespace(parts=SimpleNamespace(transfer_config=transfer), scheduler=Scheduler())


async def wait(prefill: SimpleNamespace, handoff: SimpleNamespace, moving_s: float) -> float:
    """Frames move every 0.1 s for ``moving_s``, then the ack comes 0.1 s later."""
    job = SimpleNamespace(request_id="r", first_token_s=time.monotonic())
    started = job.first_token_s

    async def sender() -> None:
        while time.monotonic() - started < moving_s:  # bounded by moving_s
            await asyncio.sleep(0.1)
            handoff.progressed_s = time.monotonic()
        await asyncio.sleep(0.1)
        handoff.ack.set_result(AckHeader("r", "h", 1, True))

    task = asyncio.create_task(sender())
    try:
        await PrefillNode._ack_while_moving(prefill, job, handoff)
    finally:
        task.cancel()
    return time.monotonic() - started


def test_the_ack_is_awaited_past_the_timeout_while_frames_move():
    async def main():
        handoff = SimpleNamespace(progressed_s=None, ack=asyncio.get_running_loop().create_future())
        prefill = node()
        return await wait(prefill, handoff, moving_s=3 * TIMEOUT_S), prefill.scheduler.moves

    took, moves = asyncio.run(main())
    assert took > 3 * TIMEOUT_S
    assert len(moves) >= 2 and moves == sorted(moves)  # the scheduler's deadline moved on


def test_no_frame_moving_for_the_timeout_gives_up():
    async def main():
        handoff = SimpleNamespace(progressed_s=None, ack=asyncio.get_running_loop().create_future())
        job = SimpleNamespace(request_id="r", first_token_s=time.monotonic())
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await PrefillNode._ack_while_moving(node(), job, handoff)
        return time.monotonic() - started

    assert TIMEOUT_S <= asyncio.run(main()) < 10 * TIMEOUT_S
