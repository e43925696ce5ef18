"""One completion request on the front, from its plan to its usage.

Its place in the whole path: docs/cluster-flow.md, "One request on the router".

A ``Completion`` holds everything the front keeps for one request: what the
response is (``meta``, streamed or not, usage wanted), the ``GenerationRequest``
it sends to the backend, the backend's token stream, the text pipeline
(detokenizer, stop strings, stream filter, the ``max_tokens`` budget and EOS),
the timing for metrics, and the outcome. The front asks it for deltas, the
finish reason, the usage and whether it failed; nothing else reads the pipeline.

The budget, EOS and stop strings are the front's: when the pipeline is done the
completion closes the backend iterator itself, which cancels the request in the
engine (or on the remote nodes) and frees its memory. Events come in batches
(whatever the backend had ready); so do the deltas.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from mlxcel_plugin.engine_api import FINISH_ERROR, FINISH_LENGTH, GenerationRequest, TokenEvent
from mlxcel_plugin.errors import EngineError, NodeLostError
from mlxcel_plugin.logprobs import PromptLogprobs, TokenLogprobs
from mlxcel_plugin.text import CompletionPipeline, TextDelta
from router_plugin.http import bodies as responses
from router_plugin.http.backend import TokenBackend
from router_plugin.http.metrics import FrontMetrics


@dataclass(frozen=True)
class Echo:
    """``echo``: the prompt leads the text; ``only``: ``max_tokens`` 0, nothing generated."""

    text: str
    only: bool = False


class Completion:
    """One request's run on the front: ``start`` (or ``batches``) → deltas → outcome."""

    def __init__(
        self,
        meta: responses.ResponseMeta,
        request: GenerationRequest,
        pipeline: CompletionPipeline,
        *,
        stream: bool,
        include_usage: bool,
        arrival_s: float,
        backend: TokenBackend,
        metrics: FrontMetrics,
    ):
        self.meta = meta
        self.request = request
        self.stream = stream
        self.include_usage = include_usage
        self.arrival_s = arrival_s
        self._pipeline = pipeline
        self._backend = backend
        self._metrics = metrics
        self._last_token_s: float | None = None
        self._events: AsyncIterator[list[TokenEvent]] | None = None
        self._first: list[TokenEvent] | None = None
        self._lost = False  # the stream ended without a terminal event
        self.cached_tokens = 0  # from the first token's event: prompt tokens a node had cached
        self.echo: Echo | None = None  # set by the front for ``echo``
        # (token id, its logprobs) of each text token fed, when the request asked; and the
        # prompt's, from the first event (router_plugin/http/logprobs_body.py renders them).
        self.logprobs: list[tuple[int, TokenLogprobs]] = []
        self.prompt_logprobs: PromptLogprobs | None = None

    # ------------------------------------------------------------ the run

    async def start(self) -> None:
        """Wait for the first event, so admission/engine errors become HTTP statuses."""
        self._events = self._backend.stream(self.request)
        self._metrics.request_started(len(self.request.prompt_tokens))
        try:
            self._first = await anext(self._events)
        except StopAsyncIteration:
            self._first, self._lost = None, True
            self._pipeline.fail("the token stream ended before the first event")
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
                if self._events is None or self._pipeline.done:
                    break
                batch = await anext(self._events, None)
                if batch is None:
                    self._lost = True
                    self._pipeline.fail("the token stream ended without a finish event")
        finally:
            await self.aclose()

    async def deltas(self) -> AsyncIterator[TextDelta]:
        """Non-empty text deltas one by one (see ``batches``)."""
        async with aclosing(self.batches()) as batches:
            async for deltas in batches:
                for delta in deltas:
                    yield delta

    async def aclose(self) -> None:
        events, self._events = self._events, None
        if events is None:
            return
        self._metrics.request_ended()
        aclose = getattr(events, "aclose", None)  # async generators cancel on close
        if aclose is not None:
            await aclose()
        self._record_finish()

    # ------------------------------------------------------------ the outcome

    @property
    def done(self) -> bool:
        return self._pipeline.done

    @property
    def finish_reason(self) -> str | None:
        return self._pipeline.finish_reason

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._pipeline.stop_sequence

    def usage(self) -> dict[str, int]:
        """The response's ``usage``: the one place it is assembled (bodies, SSE, LiteLLM)."""
        prompt = len(self.request.prompt_tokens)
        return responses.usage(prompt, self._pipeline.completion_tokens, self.cached_tokens)

    def raise_if_failed(self) -> None:
        if self._pipeline.finish_reason != FINISH_ERROR:
            return
        if self._lost:
            raise NodeLostError(self._pipeline.error)
        raise EngineError(self._pipeline.error or "generation failed")

    # ------------------------------------------------------------ helpers

    @property
    def wants_logprobs(self) -> bool:
        return self.request.sampling.logprobs is not None

    def _feed(self, batch: list[TokenEvent]) -> list[TextDelta]:
        deltas, tokens = [], 0
        for event in batch:
            if self._pipeline.done:
                break
            if event.token_id is not None:
                tokens += 1
            if event.index == 0 and event.cached_tokens:
                self.cached_tokens = event.cached_tokens
                self._metrics.cached_prompt_tokens(event.cached_tokens)
            if event.index == 0 and event.prompt_logprobs is not None:
                self.prompt_logprobs = event.prompt_logprobs
            if self.echo is not None and self.echo.only:  # the token was only the engine's
                event = TokenEvent(event.request_id, 0, None, FINISH_LENGTH)
            elif event.logprobs is not None:  # EOS too, as vLLM (loglikelihood clients count it)
                self.logprobs.append((event.token_id, event.logprobs))
            delta = self._pipeline.feed(event)
            if delta:
                deltas.append(delta)
        if tokens:
            self._time_tokens(time.perf_counter(), tokens)
        return deltas

    def _time_tokens(self, now_s: float, count: int) -> None:
        """``count`` tokens arrived at ``now_s`` (one batch: they share the time)."""
        if self._last_token_s is None:
            self._metrics.first_token(now_s - self.arrival_s)
            if count > 1:
                self._metrics.next_tokens(0.0, count - 1)
        else:
            self._metrics.next_tokens(now_s - self._last_token_s, count)
        self._last_token_s = now_s

    def _record_finish(self) -> None:
        reason = self._pipeline.finish_reason
        if reason is None:
            self._metrics.failed("cancelled")
        elif reason == FINISH_ERROR:
            self._metrics.failed("engine_error")
        else:
            e2e_s = time.perf_counter() - self.arrival_s
            self._metrics.finished(reason, self._pipeline.completion_tokens, e2e_s)
