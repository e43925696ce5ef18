"""OpenAI-compatible HTTP front over any ``TokenBackend`` (hybrid or router).

The front owns text: chat template, tokenizing, detokenizing, stop strings,
the stream filter and usage. One chat request, in the order the code runs it
(docs/cluster-flow.md, "One request on the router"):

1. ``chat_completions`` parses and validates the body (``openai_schema``);
2. ``plan_chat`` renders the template, tokenizes, bounds ``max_tokens`` and
   builds the request's ``Completion`` (``completion.py``), which holds its
   state from here on: the ``GenerationRequest``, the text pipeline, the
   backend's token stream, timing and outcome;
3. ``_serve`` starts it: ``Completion.start`` calls ``backend.stream`` (on the
   router ``ClusterBackend``: admission, then a ``RoutedRequest`` places it on
   a prefill and a decode node and merges their streams);
4. ``_complete`` / ``_sse`` turn its deltas into a body or SSE events
   (``responses``, ``sse``), with the completion's finish reason and usage.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, aclosing
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route
from starlette.types import Send

from mlxcel_plugin.engine_api import GenerationRequest
from mlxcel_plugin.errors import (
    AtCapacityError,
    ContextLengthError,
    InvalidRequestError,
    MlxcelError,
    ModelNotFoundError,
)
from mlxcel_plugin.text import (
    CompletionPipeline,
    FilterMarkers,
    StreamFilter,
    TextDelta,
    TextTokenizer,
    prompt_opens_reasoning,
)
from router_plugin import responses, sse
from router_plugin.backend import TokenBackend
from router_plugin.completion import Completion
from router_plugin.metrics import CONTENT_TYPE, FrontMetrics
from router_plugin.openai_schema import (
    ChatParams,
    CommonParams,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)

logger = logging.getLogger(__name__)

# Used only when neither the request nor the model's config bounds the output.
FALLBACK_MAX_TOKENS = 4096

T = TypeVar("T")
Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


# -- errors -------------------------------------------------------------------


def error_response(exc: MlxcelError) -> JSONResponse:
    headers = {}
    if isinstance(exc, AtCapacityError):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    return JSONResponse(exc.to_openai(), status_code=exc.status_code, headers=headers)


def _http_error(status: int, message: str, code: str) -> JSONResponse:
    error_type = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    return JSONResponse(body, status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    """Every error a client sees is OpenAI-shaped, including framework 404/405/422."""

    async def on_mlxcel(_: Request, exc: MlxcelError) -> JSONResponse:
        return error_response(exc)

    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _http_error(exc.status_code, str(exc.detail), code)

    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _http_error(422, f"invalid request: {exc.errors()}", "validation_error")

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request", exc_info=exc)
        return _http_error(500, "internal server error", "internal_error")

    app.add_exception_handler(MlxcelError, on_mlxcel)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(Exception, on_unexpected)


# -- disconnects --------------------------------------------------------------


async def _until_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` in this task; cancel it (running its cleanup) if the client goes away.

    Run here rather than in a task of its own: the first token wakes the handler
    directly, one loop turn sooner.
    """
    with anyio.CancelScope() as scope:

        async def watch() -> None:
            await _until_disconnect(request)
            scope.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            return await work
        finally:
            watcher.cancel()
            # Usually it only waits on receive(): nothing to wait for, just reap it.
            watcher.add_done_callback(_retrieve)
    raise ClientDisconnected()


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # seen: no "exception was never retrieved" warning


class SSEResponse(StreamingResponse):
    """A stream whose body iterator is always closed, even on disconnect."""

    media_type = sse.MEDIA_TYPE

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            # Shielded: the cleanup (engine cancel) must run inside a cancelled scope too.
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


# -- the front ----------------------------------------------------------------


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
    ):
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.context_length = context_length or tokenizer.context_length
        self.system_fingerprint = system_fingerprint
        self.metrics = metrics
        self.markers = FilterMarkers().with_tool_openers(list(tokenizer.tool_token_ids().values()))

    # routes

    async def chat_completions(self, request: Request) -> Response:
        arrival_s = time.perf_counter()
        params = parse_chat_request(parse_json_body(await request.body()))
        return await self._serve(request, self.plan_chat(params, arrival_s))

    async def completions(self, request: Request) -> Response:
        arrival_s = time.perf_counter()
        params = parse_completion_request(parse_json_body(await request.body()))
        self._check_model(params.common.model)
        if isinstance(params.prompt, str):
            prompt = self.tokenizer.encode(params.prompt)
        else:
            prompt = self._checked_token_ids(params.prompt)
        completion = self._completion(responses.TEXT, prompt, params.common, arrival_s)
        return await self._serve(request, completion)

    def models(self) -> dict[str, Any]:
        card = {"id": self.model_id, "object": "model", "created": 0, "owned_by": "mlxcel"}
        return {"object": "list", "data": [card]}

    def health(self) -> JSONResponse:
        if self.backend.is_ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    def render_metrics(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    # request planning

    def plan_chat(self, params: ChatParams, arrival_s: float) -> Completion:
        """Chat template, tokens, stream filter and budget (shared with the LiteLLM provider)."""
        self._check_model(params.common.model)
        prompt_text = self.tokenizer.render_chat(
            params.messages, tools=params.tools, template_kwargs=params.template_kwargs
        )
        prompt = self.tokenizer.encode_chat(prompt_text)
        stream_filter = StreamFilter(
            self.markers, start_in_reasoning=prompt_opens_reasoning(prompt_text, self.markers)
        )
        return self._completion(
            responses.CHAT, prompt, params.common, arrival_s,
            stream_filter=stream_filter, parse_tools=params.tools is not None,
        )  # fmt: skip

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            message = f"the model {model!r} does not exist; this server serves {self.model_id!r}"
            raise ModelNotFoundError(message, param="model")

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
    ) -> Completion:
        param = "messages" if kind == responses.CHAT else "prompt"
        max_tokens = self._max_tokens(len(prompt), common.max_tokens, param)
        prefix = "chatcmpl" if kind == responses.CHAT else "cmpl"
        meta = responses.ResponseMeta(
            kind, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), self.model_id,
            self.system_fingerprint,
        )  # fmt: skip
        request = GenerationRequest(
            request_id=meta.id,
            prompt_tokens=tuple(prompt),
            max_tokens=max_tokens,
            sampling=common.sampling,
            stop_token_ids=self.tokenizer.eos_token_ids,
        )
        pipeline = CompletionPipeline(
            self.tokenizer, max_tokens=max_tokens, stop=common.stop,
            stream_filter=stream_filter, parse_tools=parse_tools,
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
        return SSEResponse(self._sse(completion), headers=sse.HEADERS)

    async def _complete(self, completion: Completion) -> dict[str, Any]:
        total = TextDelta()
        async for delta in completion.deltas():
            responses.accumulate(total, delta)
        completion.raise_if_failed()
        finish_reason = completion.finish_reason or "stop"
        return responses.full_body(completion.meta, total, finish_reason, completion.usage())

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
) -> FastAPI:
    """The OpenAI-compatible app; ``context_length`` defaults to the tokenizer's config."""
    front = OpenAIFront(
        backend, tokenizer, model_id,
        context_length=context_length, system_fingerprint=system_fingerprint,
        metrics=FrontMetrics(model_id),
    )  # fmt: skip
    app = FastAPI(
        title="mlxcel", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    install_error_handlers(app)
    app.state.front = front
    # Plain Starlette routes: the handlers parse their own bodies, so FastAPI's
    # per-request dependency machinery would only add latency to the first token.
    app.router.routes.append(Route("/v1/chat/completions", front.chat_completions,
                                   methods=["POST"]))
    app.router.routes.append(Route("/v1/completions", front.completions, methods=["POST"]))
    app.add_api_route("/v1/models", front.models, methods=["GET"])
    app.add_api_route("/health", front.health, methods=["GET"])
    app.add_api_route("/metrics", front.render_metrics, methods=["GET"])
    return app
