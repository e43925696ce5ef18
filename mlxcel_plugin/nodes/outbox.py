"""Frames to one link, in the order they were put, from synchronous code.

Engine callbacks and frame handlers are plain functions on the event loop;
``Outbox.put`` never blocks them, and one task per link keeps the order that
per-request ``seq`` numbers promise.

Results of one request that pile up before the task sends them go as one
RESULT frame carrying all their tokens (``seq`` is its first token's index,
so the router still sees every token in order): under load that is one frame
per request per loop wakeup instead of one per token. When nothing is queued
here or on the link, a frame goes to the link at once: a first token does not
wait a loop turn behind the KV transfer that starts right after it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass

from mlxcel_plugin.engine_api import TokenEvent
from mlxcel_plugin.link import Link, LinkClosed
from mlxcel_plugin.link.protocol.frames import Frame, Result
from mlxcel_plugin.logprobs import TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass
class _Results:
    """Consecutive results of one request, queued and not sent yet."""

    first: Result
    last: Result
    token_ids: list[int]
    logprobs: list[TokenLogprobs]  # one per token id, or none

    @classmethod
    def of(cls, result: Result) -> _Results:
        return cls(result, result, list(result.token_ids), list(result.logprobs))

    def continued_by(self, result: Result) -> bool:
        last = self.last
        return (last.finish_reason is None and last.error is None
                and result.seq == self.first.seq + len(self.token_ids)
                and result.prompt_logprobs is None  # (only a first token has them)
                and bool(result.logprobs) == bool(self.logprobs))

    def extend(self, result: Result) -> None:
        self.token_ids.extend(result.token_ids)
        self.logprobs.extend(result.logprobs)
        self.last = result

    def to_frame(self) -> Frame:
        first, last = self.first, self.last
        return Result(last.request_id, first.seq, self.token_ids, last.finish_reason,
                      last.generated_tokens, last.error, first.cached_tokens,
                      tuple(self.logprobs), first.prompt_logprobs).to_frame()


def token_result(event: TokenEvent) -> Result:
    """An engine's token event as the RESULT that reports it (its logprobs included)."""
    tokens = [] if event.token_id is None else [event.token_id]
    return Result(event.request_id, event.index, tokens, event.finish_reason,
                  event.index + len(tokens), event.error, event.cached_tokens,
                  () if event.logprobs is None else (event.logprobs,), event.prompt_logprobs)


class Outbox:
    def __init__(self, link: Link):
        self.link = link
        self._queue: collections.deque[Frame | _Results] = collections.deque()
        self._open: dict[str, _Results] = {}  # request id -> its queued results
        self._ready = asyncio.Event()
        self._sending = False  # the task holds a frame the link has not taken yet
        self._task = asyncio.create_task(self._drain(), name="link-outbox")

    def put(self, frame: Frame) -> None:
        if self.link.closed:
            return
        self._open.clear()  # later results must not overtake this frame
        if not (self._can_send_now() and self._sent_now(frame)):
            self._append(frame)

    def put_result(self, result: Result) -> None:
        """Queue a result; it joins its request's queued results when it continues them."""
        if self.link.closed:
            return
        queued = self._open.get(result.request_id)
        if queued is not None and queued.continued_by(result):
            queued.extend(result)
            return
        if self._can_send_now() and self._sent_now(result.to_frame()):
            return
        queued = _Results.of(result)
        self._open[result.request_id] = queued
        self._append(queued)

    def _can_send_now(self) -> bool:
        """Nothing waits here or on the link: a frame sent now keeps its order."""
        return not self._queue and not self._sending and self.link.idle

    def _sent_now(self, frame: Frame) -> bool:
        try:
            return self.link.try_send(frame)
        except LinkClosed:
            return True  # dropped like every frame queued for a closed link

    def _append(self, item: Frame | _Results) -> None:
        self._queue.append(item)
        self._ready.set()

    def _next_frame(self) -> Frame:
        item = self._queue.popleft()
        if isinstance(item, Frame):
            return item
        if self._open.get(item.first.request_id) is item:
            del self._open[item.first.request_id]  # sent: later results start a new frame
        return item.to_frame()

    async def _drain(self) -> None:
        try:
            while True:  # until the link closes or the outbox is closed
                if not self._queue:
                    self._ready.clear()
                    await self._ready.wait()
                    continue
                self._sending = True
                try:
                    await self.link.send(self._next_frame())
                finally:
                    self._sending = False
        except LinkClosed:
            logger.debug("outbox to %s: link closed, %d frames dropped", self.link.peer_node_id,
                         len(self._queue))

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Wait (bounded) until every queued frame went to the link."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._queue and not self._task.done():  # bounded by the deadline
            if asyncio.get_running_loop().time() > deadline:
                return
            await asyncio.sleep(0.01)

    def close(self) -> None:
        self._task.cancel()
