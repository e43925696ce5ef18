"""One request's run: backend token events → text deltas, timed for metrics.

The front owns the ``max_tokens`` budget, EOS and stop strings: when the
pipeline is done it closes the backend iterator itself, which cancels the
request in the engine (or on the remote nodes) and frees its memory.
Events come in batches (whatever the backend had ready); so do the deltas.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from mlxcel_plugin.engine_api import FINISH_ERROR, GenerationRequest, TokenEvent
from mlxcel_plugin.errors import EngineError, NodeLostError
from mlxcel_plugin.text import CompletionPipeline, TextDelta
from router_plugin.backend import TokenBackend
from router_plugin.metrics import FrontMetrics


class Generation:
    def __init__(
        self,
        backend: TokenBackend,
        request: GenerationRequest,
        pipeline: CompletionPipeline,
        metrics: FrontMetrics,
        arrival_s: float,
    ):
        self.request = request
        self.pipeline = pipeline
        self._backend = backend
        self._metrics = metrics
        self._arrival_s = arrival_s
        self._last_token_s: float | None = None
        self._events: AsyncIterator[list[TokenEvent]] | None = None
        self._first: list[TokenEvent] | None = None
        self._lost = False  # the stream ended without a terminal event

    async def start(self) -> None:
        """Wait for the first event, so admission/engine errors become HTTP statuses."""
        self._events = self._backend.stream(self.request)
        self._metrics.request_started(len(self.request.prompt_tokens))
        try:
            self._first = await anext(self._events)
        except StopAsyncIteration:
            self._first, self._lost = None, True
            self.pipeline.fail("the token stream ended before the first event")
        except BaseException:
            await self.aclose()
            raise

    async def batches(self) -> AsyncIterator[list[TextDelta]]:
        """Non-empty text deltas, a list per event batch, until the pipeline is done.

        Closes the backend stream either way.
        """
        if self._events is None:
            await self.start()
        try:
            batch = self._first
            while batch is not None:
                deltas = self._feed(batch)
                if deltas:
                    yield deltas
                if self._events is None or self.pipeline.done:
                    break
                batch = await anext(self._events, None)
                if batch is None:
                    self._lost = True
                    self.pipeline.fail("the token stream ended without a finish event")
        finally:
            await self.aclose()

    async def deltas(self) -> AsyncIterator[TextDelta]:
        """Non-empty text deltas one by one (see ``batches``)."""
        async with aclosing(self.batches()) as batches:
            async for deltas in batches:
                for delta in deltas:
                    yield delta

    def raise_if_failed(self) -> None:
        if self.pipeline.finish_reason != FINISH_ERROR:
            return
        if self._lost:
            raise NodeLostError(self.pipeline.error)
        raise EngineError(self.pipeline.error or "generation failed")

    async def aclose(self) -> None:
        events, self._events = self._events, None
        if events is None:
            return
        self._metrics.request_ended()
        aclose = getattr(events, "aclose", None)  # async generators cancel on close
        if aclose is not None:
            await aclose()
        self._record_finish()

    def _feed(self, batch: list[TokenEvent]) -> list[TextDelta]:
        deltas, tokens = [], 0
        for event in batch:
            if self.pipeline.done:
                break
            if event.token_id is not None:
                tokens += 1
            delta = self.pipeline.feed(event)
            if delta:
                deltas.append(delta)
        if tokens:
            self._time_tokens(time.perf_counter(), tokens)
        return deltas

    def _time_tokens(self, now_s: float, count: int) -> None:
        """``count`` tokens arrived at ``now_s`` (one batch: they share the time)."""
        if self._last_token_s is None:
            self._metrics.first_token(now_s - self._arrival_s)
            if count > 1:
                self._metrics.next_tokens(0.0, count - 1)
        else:
            self._metrics.next_tokens(now_s - self._last_token_s, count)
        self._last_token_s = now_s

    def _record_finish(self) -> None:
        reason = self.pipeline.finish_reason
        if reason is None:
            self._metrics.failed("cancelled")
        elif reason == FINISH_ERROR:
            self._metrics.failed("engine_error")
        else:
            e2e_s = time.perf_counter() - self._arrival_s
            self._metrics.finished(reason, self.pipeline.completion_tokens, e2e_s)
