"""The one interface a front needs from whatever produces tokens.

Hybrid mode wraps a local ``Engine``; router mode (later) wraps prefill/decode
links. The front is the same over both, so responses match by construction.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol, TypeVar

from mlxcel_plugin.engine_api import Engine, GenerationRequest, TokenEvent
from mlxcel_plugin.engine_mailbox import EngineMailbox

T = TypeVar("T")


class TokenBackend(Protocol):
    def stream(self, request: GenerationRequest) -> AsyncIterator[list[TokenEvent]]:
        """Token events for ``request`` in order, ending with one terminal event.

        Each item is every event available when the consumer asked (at least
        one), so a burst of tokens is relayed with one write. Closing the
        iterator early (``aclose()``, or the consuming task being cancelled)
        cancels the request and frees its memory.
        """
        ...

    def is_ready(self) -> bool:
        """Whether requests can be served now (``GET /health``)."""
        ...


async def next_batch(queue: asyncio.Queue[T]) -> list[T]:
    """Wait for one item, then take every item already queued behind it."""
    batch = [await queue.get()]
    while not queue.empty():
        batch.append(queue.get_nowait())
    return batch


class LocalEngineBackend:
    """Adapts an ``Engine``'s thread callbacks to an async iterator."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def is_ready(self) -> bool:
        return True

    async def stream(self, request: GenerationRequest) -> AsyncIterator[list[TokenEvent]]:
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        # One per request, on this call's loop (a LiteLLM caller may use several loops):
        # events the engine thread emits in a burst wake the loop once.
        mailbox = EngineMailbox(asyncio.get_running_loop(), queue.put_nowait)
        self.engine.generate(request, mailbox.put)
        finished = False
        try:
            while not finished:
                batch = await next_batch(queue)
                finished = batch[-1].finish_reason is not None  # the terminal event is last
                yield batch
        finally:
            if not finished:
                self.engine.cancel(request.request_id)
