"""Frames to one link, in the order they were put, from synchronous code.

Engine callbacks and frame handlers are plain functions on the event loop;
``Outbox.put`` never blocks them, and one task per link keeps the order that
per-request ``seq`` numbers promise.
"""

from __future__ import annotations

import asyncio
import logging

from mlxcel_plugin.frames import Frame
from mlxcel_plugin.link import Link, LinkClosed

logger = logging.getLogger(__name__)


class Outbox:
    def __init__(self, link: Link):
        self.link = link
        self._queue: asyncio.Queue[Frame] = asyncio.Queue()
        self._task = asyncio.create_task(self._drain(), name="link-outbox")

    def put(self, frame: Frame) -> None:
        if not self.link.closed:
            self._queue.put_nowait(frame)

    async def _drain(self) -> None:
        try:
            while True:  # until the link closes or the outbox is closed
                await self.link.send(await self._queue.get())
        except LinkClosed:
            logger.debug("outbox to %s: link closed, %d frames dropped", self.link.peer_node_id,
                         self._queue.qsize())

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Wait (bounded) until every queued frame went to the link."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self._queue.empty() and not self._task.done():  # bounded by the deadline
            if asyncio.get_running_loop().time() > deadline:
                return
            await asyncio.sleep(0.01)

    def close(self) -> None:
        self._task.cancel()
