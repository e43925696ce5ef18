"""LoopWatchdog: a loop blocked past ``stall_s`` is reported once, with the blocking frame,
and again when it turns; a loop that keeps turning is never reported."""

from __future__ import annotations

import asyncio
import logging
import time

from mlxcel_plugin.loop_stalls import LoopWatchdog

STALL_S, INTERVAL_S = 0.2, 0.02


def blocking_step() -> None:
    time.sleep(4 * STALL_S)  # what a stalled handler does: the loop cannot turn meanwhile


async def watched(body) -> LoopWatchdog:
    watchdog = LoopWatchdog(asyncio.get_running_loop(), STALL_S, INTERVAL_S).start()
    try:
        await asyncio.sleep(3 * INTERVAL_S)
        await body()
        await asyncio.sleep(5 * INTERVAL_S)  # the loop turns again: the end is reported
    finally:
        watchdog.stop()
    return watchdog


def test_a_blocked_loop_is_reported_once_with_the_frame_that_blocks_it(caplog):
    async def block() -> None:
        blocking_step()

    with caplog.at_level(logging.WARNING, logger="mlxcel_plugin.loop_stalls"):
        watchdog = asyncio.run(watched(block))
    messages = [record.getMessage() for record in caplog.records]
    assert watchdog.stalls == 1, messages
    (stalled,) = [m for m in messages if "has not turned" in m]
    assert stalled.splitlines()[-1].endswith("in blocking_step")  # the innermost frame
    assert any("turned again after" in m for m in messages), messages


def test_a_loop_that_keeps_turning_is_never_reported(caplog):
    async def turn() -> None:
        for _ in range(20):
            await asyncio.sleep(STALL_S / 4)

    with caplog.at_level(logging.WARNING, logger="mlxcel_plugin.loop_stalls"):
        watchdog = asyncio.run(watched(turn))
    assert watchdog.stalls == 0 and not caplog.records
