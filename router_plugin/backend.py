"""The one interface a front needs from whatever produces tokens.

Hybrid mode wraps a local ``Engine``; router mode (later) wraps prefill/decode
links. The front is the same over both, so responses match by construction.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from mlxcel_plugin.engine_api import Engine, GenerationRequest, TokenEvent


class TokenBackend(Protocol):
    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Token events for ``request``, ending with one terminal event.

        Closing the iterator early (``aclose()``, or the consuming task being
        cancelled) cancels the request and frees its memory.
        """
        ...

    def is_ready(self) -> bool:
        """Whether requests can be served now (``GET /health``)."""
        ...


class LocalEngineBackend:
    """Adapts an ``Engine``'s thread callbacks to an async iterator."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def is_ready(self) -> bool:
        return True

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def emit(event: TokenEvent) -> None:  # called on the engine thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:
                pass  # the event loop is closed: nobody is left to read this event

        self.engine.generate(request, emit)
        finished = False
        try:
            while not finished:
                event = await queue.get()
                finished = event.finish_reason is not None
                yield event
        finally:
            if not finished:
                self.engine.cancel(request.request_id)
