"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` over the front's chat path.

Read and planned like a chat completion (``front.planned``), translated by
``protocol`` and planned by ``agent_bridge.plan_translated``; the deltas
become content blocks and events (``events``). Every error this API answers
is Anthropic-shaped, ``{"type": "error", "error": {"type", "message"}}``, with
the status the front would give it; after a stream began it is an ``error``
event. ``anthropic-version`` and ``anthropic-beta`` headers are accepted.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mlxcel_plugin.errors import AtCapacityError, MlxcelError
from router_plugin.http import sse
from router_plugin.http.agent_bridge import (
    IgnoredFields,
    count_prompt_tokens,
    plan_translated,
    usage_counts,
)
from router_plugin.http.completion import Completion
from router_plugin.http.messages_api.events import MessageEvents, sse_event, usage_body
from router_plugin.http.messages_api.protocol import (
    IGNORED,
    RENAMES,
    field_error,
    parse_messages_request,
)
from router_plugin.http.request_limits import parse_json_body
from router_plugin.http.stream import ClientDisconnected, SSEResponse, run_until_disconnect

API = "messages"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               415: "invalid_request_error", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}  # fmt: skip


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(exc: MlxcelError) -> JSONResponse:
    headers = {}
    if isinstance(exc, AtCapacityError):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    return JSONResponse(error_body(exc.status_code, exc.message), status_code=exc.status_code,
                        headers=headers)  # fmt: skip


class MessagesServing:
    def __init__(self, front: Any):
        self.front = front  # the OpenAIFront: its tokenizer, limits, metrics and chat planning
        self.ignored = IgnoredFields(API, IGNORED)

    async def create(self, request: Request) -> Response:
        self.front.metrics.api_request(API)
        try:
            stream, completion = await self.front.planned(request, self._plan)
            if not stream:
                body = await run_until_disconnect(request, self._complete(completion))
                return JSONResponse(body)
            await run_until_disconnect(request, completion.start())
        except MlxcelError as exc:
            return error_response(exc)
        except ClientDisconnected:
            return Response(status_code=499)
        return SSEResponse(self._stream(completion), headers=sse.HEADERS)

    async def count_tokens(self, request: Request) -> Response:
        self.front.metrics.api_request("count_tokens")
        try:
            tokens = await self.front.planned(request, self._count)
        except MlxcelError as exc:
            return error_response(exc)
        return JSONResponse({"input_tokens": tokens})

    # planning

    def _chat_body(self, raw: bytes, *, count_only: bool) -> tuple[dict[str, Any], bool]:
        body = parse_json_body(raw, self.front.options.max_json_depth)
        self.ignored.note(body)
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise field_error("stream", "expected a boolean")
        chat_body = parse_messages_request(body, self.ignored.skip_tool, count_only=count_only)
        return chat_body, bool(stream)

    def _plan(self, raw: bytes, arrival_s: float, in_thread: bool) -> tuple[bool, Completion]:
        chat_body, stream = self._chat_body(raw, count_only=False)
        return stream, plan_translated(self.front, chat_body, arrival_s, in_thread, RENAMES)

    def _count(self, raw: bytes, arrival_s: float, in_thread: bool) -> int:
        chat_body, _ = self._chat_body(raw, count_only=True)
        return count_prompt_tokens(self.front, chat_body, RENAMES)

    def _head(self) -> dict[str, Any]:
        return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                "model": self.front.model_id}  # fmt: skip

    # serving

    async def _complete(self, completion: Completion) -> dict[str, Any]:
        events = MessageEvents(self._head())
        async for delta in completion.deltas():
            events.feed(delta)
        completion.raise_if_failed()
        return events.body(completion.finish_reason, completion.stop_sequence,
                           usage_body(*usage_counts(completion)))  # fmt: skip

    async def _stream(self, completion: Completion) -> AsyncIterator[bytes]:
        events = MessageEvents(self._head())
        prompt_tokens = len(completion.request.prompt_tokens)
        pending = b"".join(map(sse_event, events.start(usage_body(prompt_tokens, 0, 0))))
        async with aclosing(completion.batches()) as batches:
            async for deltas in batches:
                for delta in deltas:
                    pending += b"".join(map(sse_event, events.feed(delta)))
                yield pending
                pending = b""
        try:
            completion.raise_if_failed()
        except MlxcelError as exc:
            yield pending + sse_event(error_body(exc.status_code, exc.message))
            return
        usage = usage_body(*usage_counts(completion))
        finish = events.finish(completion.finish_reason, completion.stop_sequence, usage)
        yield pending + b"".join(map(sse_event, finish))

