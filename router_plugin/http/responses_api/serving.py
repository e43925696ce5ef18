"""``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}`` over the front's chat path.

A request is read and planned like a chat completion (``front.planned``:
body limits, off-loop planning of big bodies, refusals counted), translated
by ``protocol`` and planned by ``agent_bridge.plan_translated``; its deltas
become output items and events (``events``). With ``store`` (default true)
the finished response and its conversation go to the ``ResponseStore``, so
``previous_response_id`` continues it. Errors are OpenAI-shaped (the front's
handlers); an error after the stream began is a ``response.failed`` event.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mlxcel_plugin.engine_api import FINISH_LENGTH
from mlxcel_plugin.errors import InvalidRequestError, MlxcelError
from router_plugin.http import sse
from router_plugin.http.agent_bridge import IgnoredFields, plan_translated, usage_counts
from router_plugin.http.completion import Completion
from router_plugin.http.request_limits import parse_json_body
from router_plugin.http.responses_api.events import ResponseEvents, output_as_messages, usage_body
from router_plugin.http.responses_api.protocol import (
    IGNORED,
    RENAMES,
    ResponsesRequest,
    conversation,
    parse_responses_request,
)
from router_plugin.http.responses_api.store import ResponseStore
from router_plugin.http.stream import ClientDisconnected, SSEResponse, run_until_disconnect

API = "responses"


class ResponseNotFoundError(InvalidRequestError):
    status_code = 404
    code = "not_found"


class Turn:
    """One planned response: the request, its conversation, the completion, the builder."""

    def __init__(self, parsed: ResponsesRequest, messages: list[dict[str, Any]],
                 completion: Completion, head: dict[str, Any]):  # fmt: skip
        self.parsed = parsed
        self.messages = messages  # the conversation sent, without the instructions
        self.completion = completion
        self.events = ResponseEvents(head)

    def outcome(self) -> tuple[str, dict[str, Any]]:
        """(status, extra body fields) once the completion is done and did not fail."""
        if self.completion.finish_reason == FINISH_LENGTH:
            return "incomplete", {"incomplete_details": {"reason": "max_output_tokens"}}
        return "completed", {}

    def usage(self) -> dict[str, Any]:
        return usage_body(*usage_counts(self.completion))


def sse_event(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {sse.dumps(event)}\n\n".encode()


class ResponsesServing:
    def __init__(self, front: Any, store: ResponseStore):
        self.front = front  # the OpenAIFront: its tokenizer, limits, metrics and chat planning
        self.store = store
        self.ignored = IgnoredFields(API, IGNORED)

    # routes

    async def create(self, request: Request) -> Response:
        self.front.metrics.api_request(API)
        turn: Turn = await self.front.planned(request, self._plan)
        try:
            if not turn.parsed.stream:
                body = await run_until_disconnect(request, self._complete(turn))
                return JSONResponse(body)
            await run_until_disconnect(request, turn.completion.start())
        except ClientDisconnected:
            return Response(status_code=499)
        return SSEResponse(self._stream(turn), headers=sse.HEADERS)

    async def by_id(self, request: Request) -> JSONResponse:
        """``GET`` (the stored body) or ``DELETE`` a stored response."""
        self.front.metrics.api_request(API)
        stored = self._stored(request)
        if request.method == "GET":
            return JSONResponse(stored.body)
        response_id = stored.body["id"]
        self.store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    # planning

    def _plan(self, raw: bytes, arrival_s: float, in_thread: bool) -> Turn:
        body = parse_json_body(raw, self.front.options.max_json_depth)
        self.ignored.note(body)
        parsed = parse_responses_request(body, self.ignored.skip_tool)
        earlier = self._earlier(parsed.previous_response_id)
        chat_body = conversation(parsed, earlier)
        completion = plan_translated(self.front, chat_body, arrival_s, in_thread, RENAMES)
        return Turn(parsed, [*earlier, *parsed.messages], completion, self._head(parsed))

    def _earlier(self, response_id: str | None) -> list[dict[str, Any]]:
        if response_id is None:
            return []
        entry = self.store.get(response_id)
        if entry is None:
            raise InvalidRequestError(
                f"previous response with id {response_id!r} not found (never stored, deleted, "
                "or dropped from this server's bounded in-memory store)",
                param="previous_response_id", code="previous_response_not_found")  # fmt: skip
        return entry.messages

    def _head(self, parsed: ResponsesRequest) -> dict[str, Any]:
        return {
            "id": f"resp_{uuid.uuid4().hex}", "object": "response",
            "created_at": int(time.time()), "model": self.front.model_id, **parsed.echo,
            "previous_response_id": parsed.previous_response_id, "store": parsed.store,
            "background": False, "reasoning": {"effort": None, "summary": None},
            "truncation": "disabled", "user": None,
        }  # fmt: skip

    def _stored(self, request: Request) -> Any:
        response_id = request.path_params["response_id"]
        entry = self.store.get(response_id)
        if entry is None:
            error = ResponseNotFoundError(f"response with id {response_id!r} not found",
                                          param="response_id")  # fmt: skip
            self.front.refused(error.status_code, str(error.code))
            raise error
        return entry

    # serving

    async def _complete(self, turn: Turn) -> dict[str, Any]:
        async for delta in turn.completion.deltas():
            turn.events.feed(delta)
        turn.completion.raise_if_failed()
        status, extra = turn.outcome()
        events = turn.events.finish(status, turn.usage(), **extra)
        body = events[-1]["response"]
        self._keep(turn, body)
        return body

    async def _stream(self, turn: Turn) -> AsyncIterator[bytes]:
        pending = b"".join(map(sse_event, turn.events.start()))
        async with aclosing(turn.completion.batches()) as batches:
            async for deltas in batches:
                for delta in deltas:
                    pending += b"".join(map(sse_event, turn.events.feed(delta)))
                yield pending
                pending = b""
        yield pending + b"".join(map(sse_event, self._last_events(turn)))

    def _last_events(self, turn: Turn) -> list[dict[str, Any]]:
        try:
            turn.completion.raise_if_failed()
        except MlxcelError as exc:
            error = {"code": exc.code or "server_error", "message": exc.message}
            return turn.events.finish("failed", turn.usage(), error=error)
        status, extra = turn.outcome()
        events = turn.events.finish(status, turn.usage(), **extra)
        self._keep(turn, events[-1]["response"])
        return events

    def _keep(self, turn: Turn, body: dict[str, Any]) -> None:
        if turn.parsed.store:
            self.store.put(body, [*turn.messages, *output_as_messages(body["output"])])
