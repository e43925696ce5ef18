"""OpenAI-compatible HTTP front over any ``TokenBackend`` (hybrid or router).

The front owns text: chat template, tokenizing, detokenizing, stop strings,
the stream filter and usage. One chat request, in the order the code runs it
(docs/cluster-flow.md, "One request on the router"):

1. ``chat_completions`` reads the body within ``--max-request-bytes`` and
   checks it as JSON (``request_limits``), then each field
   (``openai_schema``); a body of ``off_loop_bytes`` or more is planned (this
   step and the next) in a worker thread, so it cannot stall other streams;
2. ``plan_chat`` refuses a prompt its size alone shows is over the context,
   renders the template, tokenizes, bounds ``max_tokens`` and
   builds the request's ``Completion`` (``completion.py``), which holds its
   state from here on: the ``GenerationRequest``, the text pipeline, the
   backend's token stream, timing and outcome;
3. ``_serve`` starts it: ``Completion.start`` calls ``backend.stream`` (on the
   router ``ClusterBackend``: admission, then a ``RoutedRequest`` places it on
   a prefill and a decode node and merges their streams);
4. ``_complete`` / ``_sse`` turn its deltas into a body or SSE events
   (``responses``, ``sse``), with the completion's finish reason and usage.

Around it: ``--api-key`` (``api_keys``), OpenAI-shaped errors (``http_errors``),
the OpenAPI schema at ``/openapi.json`` and ``/docs`` (``openapi_models``).
Refusals before a request starts are counted in ``request_errors_total``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, aclosing
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.routing import Route

from mlxcel_plugin.engine_api import GenerationRequest
from mlxcel_plugin.errors import (
    ContextLengthError,
    InvalidRequestError,
    MlxcelError,
    ModelNotFoundError,
)
from mlxcel_plugin.text import (
    CompletionPipeline,
    StreamFilter,
    TextDelta,
    TextTokenizer,
    prompt_opens_reasoning,
)
from router_plugin.http import bodies as responses
from router_plugin.http import logprobs_body, sse
from router_plugin.http.agent_routes import install_agent_routes
from router_plugin.http.api_keys import ApiKeyMiddleware, ApiKeys
from router_plugin.http.backend import TokenBackend
from router_plugin.http.completion import Completion
from router_plugin.http.errors import error_response, install_error_handlers
from router_plugin.http.metrics import CONTENT_TYPE, FrontMetrics
from router_plugin.http.openai_schema import (
    ChatParams,
    CommonParams,
    parse_chat_request,
    parse_completion_request,
    with_forced_tool_call,
)
from router_plugin.http.openapi_models import ROUTE_DOCS, install_openapi
from router_plugin.http.options import FrontOptions
from router_plugin.http.request_limits import body_limit, parse_json_body, read_body
from router_plugin.http.stream import ClientDisconnected, SSEResponse, run_until_disconnect

# Re-exported: these lived here before the front was split by concept.
__all__ = [
    "ClientDisconnected",
    "OpenAIFront",
    "SSEResponse",
    "error_response",
    "install_error_handlers",
    "make_app",
    "run_until_disconnect",
]

logger = logging.getLogger(__name__)

# Used only when neither the request nor the model's config bounds the output.
FALLBACK_MAX_TOKENS = 4096
# Big bodies planned at once in worker threads (each tokenizer call uses a core).
OFF_LOOP_PLANS = 2

T = TypeVar("T")
Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]
# (raw body, arrival time, in a worker thread) -> the planned request
Planner = Callable[[bytes, float, bool], T]


class OpenAIFront:
    def __init__(
        self,
        backend: TokenBackend,
        tokenizer: TextTokenizer,
        model_id: str,
        *,
        context_length: int | None,
        system_fingerprint: str | None,
        metrics: FrontMetrics,
        options: FrontOptions | None = None,
    ):
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.context_length = context_length or tokenizer.context_length
        self.system_fingerprint = system_fingerprint
        self.metrics = metrics
        self.options = options or FrontOptions()
        self._off_loop = anyio.CapacityLimiter(OFF_LOOP_PLANS)
        self.body_limit = body_limit(self.options.max_request_bytes, self._max_prompt_chars())
        self.markers = tokenizer.filter_markers  # the model's tool markup (text/tool_parsers.py)
        self.adapters: dict[str, str] = {}  # LoRA adapter name -> its base (a request's model)

    # routes

    async def chat_completions(self, request: Request) -> Response:
        self.metrics.api_request("chat_completions")
        completion = await self.planned(request, self._plan_chat_body)
        return await self._serve(request, completion)

    async def completions(self, request: Request) -> Response:
        self.metrics.api_request("completions")
        completion = await self.planned(request, self._plan_completion_body)
        return await self._serve(request, completion)

    def models(self) -> dict[str, Any]:
        card = {"id": self.model_id, "object": "model", "created": 0, "owned_by": "mlxcel",
                "max_model_len": self.context_length}  # vLLM's name for the context
        adapters = [{**card, "id": name, "parent": base} for name, base in self.adapters.items()]
        return {"object": "list", "data": [card, *adapters]}

    def health(self) -> JSONResponse:
        if self.backend.is_ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    def render_metrics(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    def refused(self, status: int, code: str) -> None:
        self.metrics.failed(code, status)

    # request planning

    async def planned(self, request: Request, plan: Planner[T]) -> T:
        """The body read and planned (also the agent APIs'); a refusal is counted, then raised."""
        arrival_s = time.perf_counter()
        try:
            raw = await read_body(request, self.body_limit)
            if len(raw) < self.options.off_loop_bytes:
                return plan(raw, arrival_s, False)
            return await anyio.to_thread.run_sync(plan, raw, arrival_s, True,
                                                  limiter=self._off_loop)  # fmt: skip
        except MlxcelError as exc:
            self.refused(exc.status_code, str(exc.code))
            raise

    def _plan_chat_body(self, raw: bytes, arrival_s: float, in_thread: bool) -> Completion:
        body = parse_json_body(raw, self.options.max_json_depth)
        return self.plan_chat(parse_chat_request(body), arrival_s, in_thread=in_thread)

    def _plan_completion_body(self, raw: bytes, arrival_s: float, in_thread: bool) -> Completion:
        params = parse_completion_request(parse_json_body(raw, self.options.max_json_depth))
        self._check_model(params.common.model)
        if isinstance(params.prompt, str):
            self._check_size(len(params.prompt), "prompt")
            if in_thread:
                prompt = self._encoded_in_thread(params.prompt, True, "prompt")
            else:
                prompt = self.tokenizer.encode(params.prompt)
        else:
            prompt = self._checked_token_ids(params.prompt)
        completion = self._completion(responses.TEXT, prompt, params.common, arrival_s)
        completion.echo = logprobs_body.echo_of(params, prompt, self.tokenizer)
        return completion

    def plan_chat(self, params: ChatParams, arrival_s: float, *,
                  in_thread: bool = False) -> Completion:  # fmt: skip
        """Chat template, tokens, stream filter and budget (shared with the LiteLLM provider)."""
        self._check_model(params.common.model)
        params = with_forced_tool_call(params, self.tokenizer.tool_parser)
        content = (m["content"] for m in params.messages if isinstance(m["content"], str))
        self._check_size(sum(map(len, content)), "messages")
        prompt_text = self.tokenizer.render_chat(
            params.messages, tools=params.tools, template_kwargs=params.template_kwargs
        )
        if in_thread:
            prompt = self._encoded_in_thread(prompt_text, False, "messages")
        else:
            prompt = self.tokenizer.encode_chat(prompt_text)
        stream_filter = StreamFilter(
            self.markers, start_in_reasoning=prompt_opens_reasoning(prompt_text, self.markers)
        )
        return self._completion(
            responses.CHAT, prompt, params.common, arrival_s,
            stream_filter=stream_filter, parse_tools=params.tools is not None, tools=params.tools,
        )  # fmt: skip

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id and model not in self.adapters:
            message = f"the model {model!r} does not exist; GET /v1/models lists those served"
            raise ModelNotFoundError(message, param="model")

    def _encoded_in_thread(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        ids = self.tokenizer.encode_in_thread(text, add_special_tokens=add_special_tokens,
                                              max_tokens=self.context_length)  # fmt: skip
        if isinstance(ids, int):  # a count: at least the whole context
            message = f"the prompt has {ids} tokens; the model's context is {self.context_length}"
            raise ContextLengthError(f"{message} tokens", param=param)
        return ids

    def _max_prompt_chars(self) -> int | None:
        """The most characters a prompt within the context can have, where that is known."""
        if self.context_length is None or not self.tokenizer.tokens_at_least(1 << 30):
            return None
        return self.context_length * self.tokenizer.max_token_bytes

    def _check_size(self, text_chars: int, param: str) -> None:
        """Refuse before tokenizing when the text alone is longer than the context can be."""
        ctx = self.context_length
        at_least = self.tokenizer.tokens_at_least(text_chars)
        if ctx is not None and at_least >= ctx:
            message = (f"the prompt has at least {at_least} tokens; the model's context is "
                       f"{ctx} tokens")  # fmt: skip
            raise ContextLengthError(message, param=param)

    def _checked_token_ids(self, ids: list[int]) -> list[int]:
        if any(t >= self.tokenizer.vocab_size for t in ids):
            message = f"token ids must be below the vocabulary size {self.tokenizer.vocab_size}"
            raise InvalidRequestError(message, param="prompt")
        return ids

    def _max_tokens(self, prompt_len: int, requested: int | None, param: str) -> int:
        ctx = self.context_length
        if not prompt_len:
            raise InvalidRequestError("the prompt is empty", param=param)
        if ctx is not None and prompt_len >= ctx:
            message = f"the prompt has {prompt_len} tokens; the model's context is {ctx} tokens"
            raise ContextLengthError(message, param=param)
        room = ctx - prompt_len if ctx is not None else FALLBACK_MAX_TOKENS
        # Clamped rather than refused: the output simply ends with "length" at the context end.
        return min(requested, room) if requested is not None else room

    def _completion(
        self,
        kind: str,
        prompt: list[int],
        common: CommonParams,
        arrival_s: float,
        *,
        stream_filter: StreamFilter | None = None,
        parse_tools: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> Completion:
        param = "messages" if kind == responses.CHAT else "prompt"
        max_tokens = self._max_tokens(len(prompt), common.max_tokens, param)
        prefix = "chatcmpl" if kind == responses.CHAT else "cmpl"
        adapter = common.model if common.model in self.adapters else None
        meta = responses.ResponseMeta(
            kind, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), adapter or self.model_id,
            self.system_fingerprint,
        )  # fmt: skip
        request = GenerationRequest(
            request_id=meta.id,
            prompt_tokens=tuple(prompt),
            max_tokens=max(max_tokens, 1),  # 0 (echo alone): one token, never shown
            sampling=common.sampling,
            stop_token_ids=self.tokenizer.eos_token_ids,
            adapter=adapter,
            cache_key=common.cache_key,
        )
        pipeline = CompletionPipeline(
            self.tokenizer, max_tokens=max_tokens, stop=common.stop,
            stream_filter=stream_filter, parse_tools=parse_tools, tools=tools,
        )  # fmt: skip
        return Completion(
            meta, request, pipeline, stream=common.stream, include_usage=common.include_usage,
            arrival_s=arrival_s, backend=self.backend, metrics=self.metrics,
        )  # fmt: skip

    # serving

    async def _serve(self, request: Request, completion: Completion) -> Response:
        try:
            if not completion.stream:
                body = await run_until_disconnect(request, self._complete(completion))
                return JSONResponse(body)
            await run_until_disconnect(request, completion.start())
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; ends the handler cleanly
        if logprobs_body.reports_logprobs(completion):
            events = logprobs_body.stream(completion, self.tokenizer, self._sse_end)
            return SSEResponse(events, headers=sse.HEADERS)
        return SSEResponse(self._sse(completion), headers=sse.HEADERS)

    async def _complete(self, completion: Completion) -> dict[str, Any]:
        total = TextDelta()
        async for delta in completion.deltas():
            responses.accumulate(total, delta)
        completion.raise_if_failed()
        finish_reason = completion.finish_reason or "stop"
        body = responses.full_body(completion.meta, total, finish_reason, completion.usage())
        logprobs_body.fill_body(body, completion, self.tokenizer)
        return body

    async def _sse(self, completion: Completion) -> AsyncIterator[bytes]:
        # One write per batch of deltas; the last batch goes with the end of the stream.
        pending = b""
        if completion.meta.kind == responses.CHAT:
            pending = sse.event(responses.role_chunk(completion.meta))
        events = responses.DeltaEvents(completion.meta)
        async with aclosing(completion.batches()) as batches:
            async for deltas in batches:
                pending += b"".join([events.render(delta) for delta in deltas])
                if not completion.done:
                    yield pending
                    pending = b""
        yield pending + self._sse_end(completion)

    def _sse_end(self, completion: Completion) -> bytes:
        try:
            completion.raise_if_failed()
        except MlxcelError as exc:
            # Headers are gone: the error travels as an event, then the stream ends.
            return sse.event(exc.to_openai()) + sse.DONE
        meta = completion.meta
        end = sse.event(responses.delta_chunk(meta, None, completion.finish_reason))
        if completion.include_usage:
            end += sse.event(responses.usage_chunk(meta, completion.usage()))
        return end + sse.DONE


def make_app(
    backend: TokenBackend,
    tokenizer: TextTokenizer,
    model_id: str,
    *,
    context_length: int | None = None,
    system_fingerprint: str | None = None,
    lifespan: Lifespan | None = None,
    options: FrontOptions | None = None,
) -> FastAPI:
    """The OpenAI-compatible app; ``context_length`` defaults to the tokenizer's config."""
    front = OpenAIFront(
        backend, tokenizer, model_id,
        context_length=context_length, system_fingerprint=system_fingerprint,
        metrics=FrontMetrics(model_id), options=options,
    )  # fmt: skip
    app = FastAPI(title="mlxcel", lifespan=lifespan, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")  # fmt: skip
    install_error_handlers(app, front.refused)
    app.state.front = front
    # Plain Starlette routes: the handlers parse their own bodies, so FastAPI's
    # per-request dependency machinery would only add latency to the first token.
    # Their models are declared for the schema only (``openapi_models``).
    # First in the table: matched before the docs routes FastAPI adds.
    app.router.routes[:0] = [
        Route("/v1/chat/completions", front.chat_completions, methods=["POST"]),
        Route("/v1/completions", front.completions, methods=["POST"]),
    ]
    app.add_api_route("/v1/models", front.models, methods=["GET"], **ROUTE_DOCS["models"])
    app.add_api_route("/health", front.health, methods=["GET"], **ROUTE_DOCS["health"])
    app.add_api_route("/metrics", front.render_metrics, methods=["GET"], **ROUTE_DOCS["metrics"])
    install_agent_routes(app, front)
    install_openapi(app)
    keys = ApiKeys(front.options.api_keys)
    if keys:
        app.add_middleware(ApiKeyMiddleware, keys=keys,
                           ops_require_key=front.options.metrics_require_key,
                           refused=lambda exc: front.refused(exc.status_code, str(exc.code)))
    return app
