"""The API's request and response models (pydantic), for ``/openapi.json`` and ``/docs``.

The completion routes (and the agent APIs', ``agent_openapi_models``) are
plain Starlette routes whose handlers parse their own bodies
(``openai_schema``: the hot path pays no model validation), so they are
described here by schema-only FastAPI routes that are never mounted; the
other routes are FastAPI's own. The models say what the parser accepts (same
ranges); ``tests/router_plugin/http/test_front_fuzz.py`` checks that a body the
schema refuses is a 4xx and that 200 bodies match the response models, and
``test_front_schemathesis.py`` runs schemathesis against this schema.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from router_plugin.http.agent_openapi_models import agent_schema_routes
from router_plugin.http.openai_schema import INT64_MAX, INT64_MIN


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as OpenAI does


# -- requests -------------------------------------------------------------------


class TextPart(_Open):
    type: Literal["text"]
    text: str


class FunctionCall(_Open):
    name: str | None = None
    arguments: str | dict[str, Any] | None = None


class ToolCall(_Open):
    """An earlier assistant turn's call, passed to the chat template as given."""

    function: dict[str, Any] = Field(description="name and arguments (JSON text or an object)")


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(None, description="required on a 'tool' message")


class FunctionDefinition(_Open):
    """``name``, and ``description`` and ``parameters`` (JSON schema) for the chat template."""

    name: str


class Tool(_Open):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(BaseModel):
    """Force a call to this function (on the grammar engine)."""

    type: Literal["function"]
    function: FunctionDefinition


class StreamOptions(_Open):
    include_usage: bool | None = None


class JsonSchemaFormat(_Open):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON Schema")
    strict: bool | None = Field(None, description="refuse keywords that cannot be enforced")


class ResponseFormat(_Open):
    # Structured output: docs/structured-output.md
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description="with type json_schema")


class _Sampling(_Open):
    model: str | None = Field(None, description="optional (as vLLM): one model is served")
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="default 0 (greedy)")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX, description="-1 or 0: disabled")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    n: Literal[1] | None = None
    user: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = Field(
        None, description="'required' or a named function: one call, forced by a grammar")
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = Field(None, description="each token's raw model logprob")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="needs logprobs: true")


class CompletionRequest(_Sampling):
    prompt: (str | list[int] | list[str] | list[list[int]]) = Field(
        description="one prompt: text or token ids (a list of one of either also works)"
    )
    best_of: Literal[1] | None = None
    max_tokens: int | None = Field(None, ge=0, le=INT64_MAX, description="0 only with echo")
    logprobs: int | None = Field(None, ge=0, le=5, description="alternatives per token")
    echo: bool | None = Field(None, description="the prompt first (with logprobs: its own)")


# -- responses ------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = Field(None, description='{"content": [...]} when asked')
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    """One ``data:`` event of a chat stream (the stream ends with ``data: [DONE]``)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChunkChoice]
    usage: Usage | None = None


class TextChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = Field(
        None, description="tokens, token_logprobs, top_logprobs, text_offset when asked")
    finish_reason: str | None


class TextCompletion(BaseModel):
    """A completions body, or one ``data:`` event of its stream (then ``usage`` is optional)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[TextChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None  # the model's context in tokens (vLLM's field)
    parent: str | None = None  # an adapter's base model (vLLM's field)


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class HealthStatus(BaseModel):
    status: Literal["ok", "unavailable"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# -- routes and the schema -------------------------------------------------------------

_ERRORS = {status: {"model": ErrorResponse, "description": what} for status, what in (
    (400, "invalid request"), (401, "missing or wrong API key (--api-key)"),
    (404, "unknown model"), (413, "body over --max-request-bytes"),
    (415, "body not JSON"), (503, "at capacity (Retry-After)"),
)}  # fmt: skip


def _stream_doc(chunk: type[BaseModel]) -> dict[str, Any]:
    name = chunk.__name__
    return {"content": {"text/event-stream": {"schema": {"type": "string", "description": (
        f"with stream: true, server-sent events: 'data: <{name}>' each, then 'data: [DONE]'"
    )}}}}  # fmt: skip


ROUTE_DOCS: dict[str, dict[str, Any]] = {
    "models": {"response_model": ModelList, "summary": "The served model", "responses": _ERRORS},
    "health": {"response_model": HealthStatus, "summary": "Ready to serve (503 when not)",
               "responses": {503: {"model": HealthStatus}}},
    "metrics": {"response_class": PlainTextResponse, "summary": "Prometheus metrics"},
}  # fmt: skip


async def _chat(body: ChatCompletionRequest) -> ChatCompletion:
    raise NotImplementedError  # schema only: the served route is front.chat_completions


async def _completions(body: CompletionRequest) -> TextCompletion:
    raise NotImplementedError  # schema only: the served route is front.completions


def _schema_routes() -> list[APIRoute]:
    chat = {200: _stream_doc(ChatCompletionChunk), **_ERRORS}
    text = {200: _stream_doc(TextCompletion), **_ERRORS}
    return [
        APIRoute("/v1/chat/completions", _chat, methods=["POST"], response_model=ChatCompletion,
                 responses=chat, summary="Chat completion (JSON or SSE stream)"),
        APIRoute("/v1/completions", _completions, methods=["POST"],
                 response_model=TextCompletion, responses=text,
                 summary="Text completion (JSON or SSE stream)"),
        *agent_schema_routes(_ERRORS),  # Responses and Messages (agent_openapi_models)
    ]  # fmt: skip


def _add_model(schema: dict[str, Any], model: type[BaseModel]) -> None:
    found = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(found.pop("$defs", {}))
    components[model.__name__] = found


def install_openapi(app: FastAPI) -> None:
    """``app.openapi()`` (``/openapi.json``, ``/docs``): the served and schema-only routes."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            served = [r for r in app.routes if isinstance(r, APIRoute)]
            schema = get_openapi(title=app.title, version=app.version,
                                 routes=[*_schema_routes(), *served],
                                 description="OpenAI-compatible API of an mlxcel node")  # fmt: skip
            _add_model(schema, ChatCompletionChunk)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
