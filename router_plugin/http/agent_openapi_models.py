"""Request and response models of the agent APIs (Responses, Messages), for ``/openapi.json``.

Schema only, as the chat models (``openapi_models``): the served routes parse
their own bodies (``responses_api.protocol``, ``messages_api.protocol``). The
models say what those parsers accept; fields an agent client may send and the
server ignores (``metadata``, ``include``, ``thinking`` ...) are left out,
since any value of them is accepted.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from router_plugin.http.openai_schema import INT64_MAX, INT64_MIN


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- OpenAI Responses ---------------------------------------------------------------------


class InputTextPart(_Open):
    type: Literal["input_text", "output_text", "text", "summary_text"]
    text: str


class InputMessageItem(_Open):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputTextPart]


class FunctionCallItem(_Open):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="JSON text")


class FunctionCallOutputItem(_Open):
    type: Literal["function_call_output"]
    call_id: str = Field(description="a function_call's call_id earlier in the conversation")
    output: str | list[InputTextPart]


class ReasoningItem(_Open):
    """Accepted and dropped: the model's earlier thoughts."""

    type: Literal["reasoning"]


InputItem = InputMessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class TextFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Open):
    format: TextFormat | None = None


class ResponsesNamedToolChoice(BaseModel):
    type: Literal["function"]
    name: str


class ResponsesTool(_Open):
    """``function`` tools; hosted tool types (``web_search`` ...) are skipped."""

    type: str
    name: str | None = Field(None, description="required on a function tool")


class ResponsesRequest(_Open):
    model: str | None = Field(None, description="optional: one model is served")
    input: str | list[InputItem]
    instructions: str | None = Field(None, description="the system message (not carried on)")
    previous_response_id: str | None = Field(None, description="continue a stored response")
    store: bool | None = Field(None, description="default true: keep it (bounded, in memory)")
    stream: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="default 0 (greedy)")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ResponsesNamedToolChoice | None = Field(
        None, description="'required' or a named function: one call, forced by a grammar")
    text: TextConfig | None = None


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int] = Field(description="cached_tokens")
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(_Open):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    model: str
    output: list[dict[str, Any]] = Field(description="reasoning, message, function_call items")
    usage: ResponseUsage | None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool


# -- Anthropic Messages -------------------------------------------------------------------


class TextBlock(_Open):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Open):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Open):
    type: Literal["tool_result"]
    tool_use_id: str = Field(description="a tool_use block's id earlier in the conversation")
    content: str | list[TextBlock] | None = None


class ThinkingBlock(_Open):
    """Accepted and dropped: the model's earlier thoughts."""

    type: Literal["thinking", "redacted_thinking"]


ContentBlock = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


class AnthropicMessage(_Open):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(_Open):
    """A client tool; server tool types (``web_search_*`` ...) are skipped."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class AnthropicToolChoice(_Open):
    """``any``/``tool`` force one call (on the grammar engine); ``tool`` needs ``name``."""

    type: Literal["auto", "none", "any", "tool"]
    name: str | None = None


class CountTokensRequest(_Open):
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=INT64_MAX, description="clamped to the context left")
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0, description="default 0 (greedy)")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=INT64_MAX)


class MessageUsage(BaseModel):
    input_tokens: int = Field(description="prompt tokens not read from the prefix cache")
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


class MessageObject(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]] = Field(description="thinking, text, tool_use blocks")
    stop_reason: Literal["end_turn", "max_tokens", "tool_use", "stop_sequence"]
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


# -- schema-only routes -----------------------------------------------------------------


async def _responses(body: ResponsesRequest) -> ResponseObject:
    raise NotImplementedError  # schema only: the served route is ResponsesServing.create


async def _response_by_id(response_id: str) -> ResponseObject:
    raise NotImplementedError  # schema only: ResponsesServing.by_id


async def _delete_response(response_id: str) -> DeletedResponse:
    raise NotImplementedError  # schema only: ResponsesServing.by_id


async def _messages(body: MessagesRequest) -> MessageObject:
    raise NotImplementedError  # schema only: MessagesServing.create


async def _count_tokens(body: CountTokensRequest) -> TokenCount:
    raise NotImplementedError  # schema only: MessagesServing.count_tokens


def _events(what: str) -> dict[str, Any]:
    event = {"type": "object", "properties": {"event": {"type": "string"},
                                              "data": {"type": "string"}},
             "description": f"with stream: true, each event's 'event' is its type: {what}"}
    return {"content": {"text/event-stream": {"schema": event}}}  # fmt: skip


def _anthropic_errors() -> dict[int | str, dict[str, Any]]:
    statuses = ((400, "invalid request"), (401, "missing or wrong API key"),
                (404, "unknown model"), (413, "body too large"), (415, "body not JSON"),
                (503, "at capacity (Retry-After)"))  # fmt: skip
    return {s: {"model": AnthropicError, "description": d} for s, d in statuses}


def agent_schema_routes(openai_errors: dict[int | str, dict[str, Any]]) -> list[APIRoute]:
    not_found = {404: {"model": openai_errors[400]["model"], "description": "no such response"}}
    return [
        APIRoute("/v1/responses", _responses, methods=["POST"], response_model=ResponseObject,
                 responses={200: _events("response.* events"), **openai_errors},
                 summary="OpenAI Responses (JSON or SSE stream)"),
        APIRoute("/v1/responses/{response_id}", _response_by_id, methods=["GET"],
                 response_model=ResponseObject, responses=not_found,
                 summary="A stored response"),
        APIRoute("/v1/responses/{response_id}", _delete_response, methods=["DELETE"],
                 response_model=DeletedResponse, responses=not_found,
                 summary="Delete a stored response"),
        APIRoute("/v1/messages", _messages, methods=["POST"], response_model=MessageObject,
                 responses={200: _events("message_start ... message_stop"),
                            **_anthropic_errors()},
                 summary="Anthropic Messages (JSON or SSE stream)"),
        APIRoute("/v1/messages/count_tokens", _count_tokens, methods=["POST"],
                 response_model=TokenCount, responses=_anthropic_errors(),
                 summary="Prompt tokens of a Messages request"),
    ]  # fmt: skip
