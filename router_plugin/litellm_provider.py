"""The router front inside LiteLLM: a ``CustomLLM`` that serves chat from the cluster.

LiteLLM (SDK or proxy) calls ``completion``/``acompletion``/``streaming``/
``astreaming``; each call is planned exactly like ``POST /v1/chat/completions``
on the router (``OpenAIFront.plan_chat``: validation, chat template, tokens,
stream filter, budget) and dispatched to the prefill/decode pools through a
``ClusterBackend``. So the text, usage and finish reason match the router's
own response for the same request.

Cluster settings come from the model's ``litellm_params`` (``prefill_peers``,
``decode_peers``, ``model_dir``, ``cluster_secret_file``, ...), else from the
environment (``MLXCEL_PREFILL_PEERS``, ``MLXCEL_DECODE_PEERS``,
``MLXCEL_MODEL``, ``MLXCEL_CLUSTER_SECRET_FILE``), merged by ``build_config``.
One cluster (links, health monitor, balancers) per event loop and settings,
opened on first use and reused; the sync entry points run on a private loop
thread so they share one cluster too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import litellm
from litellm import CustomLLM
from litellm.types.utils import (
    Choices,
    GenericStreamingChunk,
    Message,
    ModelResponse,
    ModelResponseStream,
    Usage,
)

from mlxcel_plugin.config import ServerConfig, build_config
from mlxcel_plugin.errors import (
    AtCapacityError,
    ConfigError,
    ContextLengthError,
    InvalidRequestError,
    MlxcelError,
)
from mlxcel_plugin.plugins import load_plugins
from mlxcel_plugin.text import TextDelta, TextTokenizer
from router_plugin import responses
from router_plugin.cluster_backend import ClusterBackend
from router_plugin.front import Job, OpenAIFront
from router_plugin.metrics import FrontMetrics
from router_plugin.openai_schema import parse_chat_request
from router_plugin.roles import make_cluster_backend, served_model_name

logger = logging.getLogger(__name__)

PROVIDER = "mlxcel"
# litellm_params key -> ServerConfig field (what the router's CLI flags set).
CLUSTER_PARAMS = {
    "prefill_peers": "prefill_peers",
    "decode_peers": "decode_peers",
    "model_dir": "model",
    "served_model_name": "served_model_name",
    "cluster_secret_file": "cluster_secret_file",
    "distributed_config": "distributed_config",
    "prefill_balancer": "prefill_balancer",
    "decode_balancer": "decode_balancer",
    "node_id": "node_id",
}
READY_TIMEOUT_PARAM = "ready_timeout_s"
PROVIDER_PARAMS = frozenset(CLUSTER_PARAMS) | {READY_TIMEOUT_PARAM}
# The first request waits this long for links to both pools before it may be refused.
DEFAULT_READY_TIMEOUT_S = 10.0
READY_POLL_S = 0.05

T = TypeVar("T")


# -- settings -------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterSettings:
    """What identifies a cluster: the flag values given in ``litellm_params`` (hashable)."""

    flags: tuple[tuple[str, Any], ...]
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S

    @classmethod
    def from_params(cls, *sources: Mapping[str, Any] | None) -> ClusterSettings:
        """Later sources win; ``None`` values count as unset (env/defaults apply)."""
        merged: dict[str, Any] = {}
        for source in sources:
            merged.update({k: v for k, v in (source or {}).items()
                           if k in PROVIDER_PARAMS and v is not None})  # fmt: skip
        timeout_s = float(merged.pop(READY_TIMEOUT_PARAM, DEFAULT_READY_TIMEOUT_S))
        # Lists from YAML become tuples so the settings can key the cluster table.
        flags = {CLUSTER_PARAMS[k]: tuple(v) if isinstance(v, list) else v
                 for k, v in merged.items()}  # fmt: skip
        return cls(tuple(sorted(flags.items())), timeout_s)

    def server_config(self, env: Mapping[str, str]) -> ServerConfig:
        """The router's config: these values over env vars over defaults."""
        config = build_config({**dict(self.flags), "role": "router"}, env)
        if not config.model:
            # Imported here: the CLI module is only needed for the embedded default model.
            from mlxcel_plugin.cli import resolve_model

            config = resolve_model(config)
        return config


def check_peers(flags: Mapping[str, Any], env: Mapping[str, str]) -> None:
    """A provider-worded error instead of the CLI's flag names."""
    for key, var in (("prefill_peers", "MLXCEL_PREFILL_PEERS"),
                     ("decode_peers", "MLXCEL_DECODE_PEERS")):  # fmt: skip
        if not flags.get(key) and not env.get(var):
            raise ConfigError(f"the mlxcel provider needs {key} in litellm_params or {var}")


# -- one cluster ----------------------------------------------------------------


@dataclass
class Cluster:
    """The router's state for one event loop: backend (links, health) and the text front."""

    backend: ClusterBackend
    front: OpenAIFront

    async def close(self) -> None:
        await self.backend.health.close()
        await self.backend.peers.close()


def _load(
    settings: ClusterSettings, env: Mapping[str, str]
) -> tuple[ServerConfig, Any, TextTokenizer]:
    # Blocking (files, tokenizer, entry points): runs in a worker thread.
    check_peers(dict(settings.flags), env)
    config = settings.server_config(env)
    return config, load_plugins(env), TextTokenizer.from_dir(str(config.model))


async def wait_until_ready(backend: ClusterBackend, timeout_s: float) -> bool:
    """Until both pools have a healthy node, or ``timeout_s``; False on timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not backend.is_ready():  # bounded by the deadline
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(READY_POLL_S)
    return True


async def open_cluster(settings: ClusterSettings, env: Mapping[str, str]) -> Cluster:
    config, registry, tokenizer = await asyncio.to_thread(_load, settings, env)
    backend = make_cluster_backend(config, registry, env)
    name = served_model_name(config)
    front = OpenAIFront(backend, tokenizer, name, context_length=None,
                        system_fingerprint=None, metrics=FrontMetrics(name))  # fmt: skip
    backend.peers.start()
    backend.health.start()
    if not await wait_until_ready(backend, settings.ready_timeout_s):
        # Not fatal: a node may come up later; until then requests get 503s.
        logger.warning("mlxcel cluster not ready after %.1fs", settings.ready_timeout_s)
    return Cluster(backend, front)


# -- LiteLLM types ----------------------------------------------------------------


def request_body(
    messages: list[Any], optional_params: Mapping[str, Any], stream: bool
) -> dict[str, Any]:
    """The OpenAI body LiteLLM was asked for, minus our cluster settings."""
    body = {k: v for k, v in optional_params.items()
            if k not in PROVIDER_PARAMS and k != "extra_body" and v is not None}  # fmt: skip
    body.update(optional_params.get("extra_body") or {})
    return {**body, "messages": messages, "stream": stream}


def fill_model_response(
    response: ModelResponse, job: Job, total: TextDelta, model: str
) -> ModelResponse:
    counts = responses.usage(len(job.request.prompt_tokens), job.pipeline.completion_tokens)
    body = responses.full_body(job.meta, total, job.pipeline.finish_reason or "stop", counts)
    choice = body["choices"][0]
    response.id, response.created, response.model = body["id"], body["created"], model
    response.choices = [Choices(index=0, finish_reason=choice["finish_reason"],
                                message=Message(**choice["message"]))]  # fmt: skip
    response.usage = Usage(**counts)  # type: ignore[attr-defined]
    return response


def delta_chunk(job: Job, delta: TextDelta, model: str, *, first: bool) -> ModelResponseStream:
    # ModelResponseStream, not GenericStreamingChunk: only it carries reasoning_content.
    body = {**responses.delta_chunk(job.meta, delta), "model": model}
    if first:  # the role comes with the first delta, as OpenAI sends it
        body["choices"][0]["delta"]["role"] = "assistant"
    return ModelResponseStream(**body)


def final_chunk(job: Job) -> GenericStreamingChunk:
    # A GenericStreamingChunk on purpose: LiteLLM drops a content-less ModelResponseStream
    # after the finish reason, usage included, and would count tokens itself.
    counts = responses.usage(len(job.request.prompt_tokens), job.pipeline.completion_tokens)
    return GenericStreamingChunk(
        text="",
        tool_use=None,
        is_finished=True,
        index=0,
        finish_reason=job.pipeline.finish_reason or "stop",
        usage=counts,
    )  # type: ignore[typeddict-item]


def to_litellm_error(exc: MlxcelError, model: str, provider: str) -> Exception:
    """The LiteLLM exception with the status the router would answer."""
    message = exc.message
    if isinstance(exc, ContextLengthError):
        return litellm.ContextWindowExceededError(message, model, provider)
    if isinstance(exc, InvalidRequestError) and exc.status_code == 400:
        return litellm.BadRequestError(message, model, provider)
    if isinstance(exc, AtCapacityError):
        retry_after = str(max(1, round(exc.retry_after_s)))
        response = httpx.Response(
            503,
            headers={"retry-after": retry_after},
            request=httpx.Request("POST", f"mlxcel://{provider}"),
        )
        return litellm.ServiceUnavailableError(message, provider, model, response=response)
    return litellm.APIError(exc.status_code, message, provider, model)


# -- the sync bridge ----------------------------------------------------------------


# Coroutines, not bare awaitables: run_coroutine_threadsafe accepts nothing else.
async def _next_or(items: AsyncIterator[T], default: Any) -> T | Any:
    return await anext(items, default)


async def _aclose(items: AsyncIterator[Any]) -> None:
    await items.aclose()  # type: ignore[attr-defined]


class LoopThread:
    """A private event loop on a daemon thread, for LiteLLM's sync entry points."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def started(self) -> bool:
        return self._loop is not None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:  # two sync callers at once must not start two loops
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever,
                                                name="mlxcel-litellm", daemon=True)  # fmt: skip
                self._thread.start()
            return self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        finally:
            future.cancel()  # a no-op when done; stops the work if the caller was interrupted

    def iterate(self, items: AsyncIterator[T]) -> Iterator[T]:
        """``items`` consumed on the loop thread; closing this generator closes them."""
        done = object()
        try:
            while (item := self.run(_next_or(items, done))) is not done:  # ends with the stream
                yield item  # type: ignore[misc]
        finally:
            self.run(_aclose(items))

    def close(self, timeout_s: float = 5.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)
        if not thread.is_alive():
            loop.close()
        self._loop = self._thread = None


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

    async def _plan(self, call: Call, stream: bool) -> tuple[Cluster, Job]:
        cluster = await self.cluster(call.settings())
        params = parse_chat_request(call.body(stream))
        return cluster, cluster.front.plan_chat(params, time.perf_counter())

    async def _complete(self, call: Call, model_response: ModelResponse) -> ModelResponse:
        try:
            cluster, job = await self._plan(call, stream=False)
            generation = cluster.front.generation(job)
            total = TextDelta()
            async with aclosing(generation.deltas()) as deltas:
                async for delta in deltas:
                    responses.accumulate(total, delta)
            generation.raise_if_failed()
        except MlxcelError as exc:
            raise call.error(exc) from exc
        return fill_model_response(model_response, job, total, call.model)

    async def _stream(
        self, call: Call
    ) -> AsyncIterator[ModelResponseStream | GenericStreamingChunk]:
        try:
            cluster, job = await self._plan(call, stream=True)
            generation = cluster.front.generation(job)
            try:
                await generation.start()  # admission and engine errors before any chunk
                first = True
                async with aclosing(generation.deltas()) as deltas:
                    async for delta in deltas:
                        yield delta_chunk(job, delta, call.model, first=first)
                        first = False
            finally:
                await generation.aclose()  # the consumer left early: cancel on the nodes
            generation.raise_if_failed()
        except MlxcelError as exc:
            raise call.error(exc) from exc
        yield final_chunk(job)
