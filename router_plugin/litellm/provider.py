"""The router front inside LiteLLM: a ``CustomLLM`` that serves chat from the cluster.

LiteLLM (SDK or proxy) calls ``completion``/``acompletion``/``streaming``/
``astreaming``; each call is planned exactly like ``POST /v1/chat/completions``
on the router (``OpenAIFront.plan_chat``: validation, chat template, tokens,
stream filter, budget) and dispatched to the prefill/decode pools through a
``ClusterBackend``. So the text, usage and finish reason match the router's
own response for the same request.

Cluster settings come from the model's ``litellm_params``, else from the
environment (``litellm_cluster``). One cluster (links, health monitor,
balancers) per event loop and settings, opened on first use and reused; the
sync entry points run on a private loop thread (``loop_thread``) so they share
one cluster too. ``litellm_types`` maps results and errors into LiteLLM's types.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from litellm import CustomLLM
from litellm.types.utils import GenericStreamingChunk, ModelResponse, ModelResponseStream

from mlxcel_plugin.errors import MlxcelError
from mlxcel_plugin.text import TextDelta
from router_plugin.http import bodies as responses
from router_plugin.http.completion import Completion
from router_plugin.http.openai_schema import parse_chat_request
from router_plugin.litellm.cluster import (
    CLUSTER_PARAMS,
    PROVIDER_PARAMS,
    Cluster,
    ClusterSettings,
    check_peers,
    open_cluster,
    wait_until_ready,
)
from router_plugin.litellm.loop_thread import LoopThread
from router_plugin.litellm.types import (
    delta_chunk,
    fill_model_response,
    final_chunk,
    request_body,
    to_litellm_error,
)

# Re-exported: these lived here before the provider was split by concept.
__all__ = [
    "CLUSTER_PARAMS",
    "PROVIDER",
    "PROVIDER_PARAMS",
    "Cluster",
    "ClusterSettings",
    "LoopThread",
    "MlxcelProvider",
    "check_peers",
    "delta_chunk",
    "fill_model_response",
    "final_chunk",
    "open_cluster",
    "request_body",
    "to_litellm_error",
    "wait_until_ready",
]

PROVIDER = "mlxcel"


# -- the provider ---------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One LiteLLM call, as the keyword arguments LiteLLM passes to a ``CustomLLM``."""

    model: str
    messages: list[Any]
    optional_params: Mapping[str, Any]
    litellm_params: Mapping[str, Any]

    @property
    def provider(self) -> str:
        return self.litellm_params.get("custom_llm_provider") or PROVIDER

    def settings(self) -> ClusterSettings:
        return ClusterSettings.from_params(self.litellm_params, self.optional_params)

    def body(self, stream: bool) -> dict[str, Any]:
        return request_body(self.messages, self.optional_params, stream)

    def error(self, exc: MlxcelError) -> Exception:
        return to_litellm_error(exc, self.model, self.provider)


def _call(
    model: str,
    messages: list[Any],
    optional_params: Mapping[str, Any] | None,
    litellm_params: Mapping[str, Any] | None,
) -> Call:
    return Call(model, messages, optional_params or {}, litellm_params or {})


class MlxcelProvider(CustomLLM):
    """Register with ``litellm.custom_provider_map`` (SDK) or ``custom_provider_map`` (proxy)."""

    def __init__(self, env: Mapping[str, str] | None = None):
        super().__init__()
        self._env = env
        self._clusters: dict[tuple[asyncio.AbstractEventLoop, ClusterSettings],
                             asyncio.Future[Cluster]] = {}  # fmt: skip
        self._sync = LoopThread()

    @property
    def env(self) -> Mapping[str, str]:
        return os.environ if self._env is None else self._env

    # LiteLLM's entry points (it passes everything by keyword)

    def completion(
        self,
        model: str,
        messages: list,
        model_response: ModelResponse,
        optional_params: dict,
        litellm_params: dict | None = None,
        **_: Any,
    ) -> ModelResponse:
        call = _call(model, messages, optional_params, litellm_params)
        return self._sync.run(self._complete(call, model_response))

    def streaming(
        self,
        model: str,
        messages: list,
        optional_params: dict,
        litellm_params: dict | None = None,
        **_: Any,
    ) -> Iterator[Any]:
        call = _call(model, messages, optional_params, litellm_params)
        return self._sync.iterate(self._stream(call))

    async def acompletion(
        self,
        model: str,
        messages: list,
        model_response: ModelResponse,
        optional_params: dict,
        litellm_params: dict | None = None,
        **_: Any,
    ) -> ModelResponse:
        call = _call(model, messages, optional_params, litellm_params)
        return await self._complete(call, model_response)

    def astreaming(  # type: ignore[override]  # an async generator, not a coroutine
        self,
        model: str,
        messages: list,
        optional_params: dict,
        litellm_params: dict | None = None,
        **_: Any,
    ) -> AsyncIterator[Any]:
        return self._stream(_call(model, messages, optional_params, litellm_params))

    # lifecycle

    async def aclose(self) -> None:
        """Close the clusters opened on the running loop (e.g. at the end of ``asyncio.run``)."""
        loop = asyncio.get_running_loop()
        for key in list(self._clusters):  # a snapshot: the sync thread may add its own
            if key[0] is not loop:
                continue
            opening = self._clusters.pop(key)
            if opening.done() and not opening.cancelled() and opening.exception() is None:
                await opening.result().close()
            else:
                opening.cancel()

    def close(self) -> None:
        """Close the sync entry points' cluster and loop thread."""
        if self._sync.started:
            self._sync.run(self.aclose())
        self._sync.close()

    # the work

    async def cluster(self, settings: ClusterSettings) -> Cluster:
        """This loop's cluster for ``settings``, opened once; concurrent callers share it."""
        loop = asyncio.get_running_loop()
        self._forget_closed_loops()
        key = (loop, settings)
        opening = self._clusters.get(key)
        if opening is None:
            opening = self._clusters[key] = loop.create_task(open_cluster(settings, self.env))
        try:
            return await asyncio.shield(opening)
        except Exception:
            # Not cached: a fixed config (say, a secret written later) gets a fresh try.
            self._clusters.pop(key, None)
            raise

    def _forget_closed_loops(self) -> None:
        # asyncio.run() closes its loop after cancelling every task on it, our links too.
        for key in list(self._clusters):  # a snapshot: the sync thread may add its own
            if key[0].is_closed():
                self._clusters.pop(key, None)

    async def _plan(self, call: Call, stream: bool) -> Completion:
        cluster = await self.cluster(call.settings())
        params = parse_chat_request(call.body(stream))
        return cluster.front.plan_chat(params, time.perf_counter())

    async def _complete(self, call: Call, model_response: ModelResponse) -> ModelResponse:
        try:
            job = await self._plan(call, stream=False)
            total = TextDelta()
            async with aclosing(job.deltas()) as deltas:
                async for delta in deltas:
                    responses.accumulate(total, delta)
            job.raise_if_failed()
        except MlxcelError as exc:
            raise call.error(exc) from exc
        return fill_model_response(model_response, job, total, call.model)

    async def _stream(
        self, call: Call
    ) -> AsyncIterator[ModelResponseStream | GenericStreamingChunk]:
        try:
            job = await self._plan(call, stream=True)
            try:
                await job.start()  # admission and engine errors before any chunk
                first = True
                async with aclosing(job.deltas()) as deltas:
                    async for delta in deltas:
                        yield delta_chunk(job, delta, call.model, first=first)
                        first = False
            finally:
                await job.aclose()  # the consumer left early: cancel on the nodes
            job.raise_if_failed()
        except MlxcelError as exc:
            raise call.error(exc) from exc
        yield final_chunk(job)
