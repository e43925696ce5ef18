"""Our results and errors in LiteLLM's types: model responses, stream chunks, exceptions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
import litellm
from litellm.types.utils import (
    Choices,
    GenericStreamingChunk,
    Message,
    ModelResponse,
    ModelResponseStream,
    Usage,
)

from mlxcel_plugin.errors import (
    AtCapacityError,
    ContextLengthError,
    InvalidRequestError,
    MlxcelError,
)
from mlxcel_plugin.text import TextDelta
from router_plugin.http import bodies as responses
from router_plugin.http.completion import Completion
from router_plugin.litellm.cluster import PROVIDER_PARAMS


def request_body(
    messages: list[Any], optional_params: Mapping[str, Any], stream: bool
) -> dict[str, Any]:
    """The OpenAI body LiteLLM was asked for, minus our cluster settings."""
    body = {k: v for k, v in optional_params.items()
            if k not in PROVIDER_PARAMS and k != "extra_body" and v is not None}  # fmt: skip
    body.update(optional_params.get("extra_body") or {})
    return {**body, "messages": messages, "stream": stream}


def fill_model_response(
    response: ModelResponse, job: Completion, total: TextDelta, model: str
) -> ModelResponse:
    counts = job.usage()
    body = responses.full_body(job.meta, total, job.finish_reason or "stop", counts)
    choice = body["choices"][0]
    response.id, response.created, response.model = body["id"], body["created"], model
    response.choices = [Choices(index=0, finish_reason=choice["finish_reason"],
                                message=Message(**choice["message"]))]  # fmt: skip
    response.usage = Usage(**counts)  # type: ignore[attr-defined]
    return response


def delta_chunk(
    job: Completion, delta: TextDelta, model: str, *, first: bool
) -> ModelResponseStream:
    # ModelResponseStream, not GenericStreamingChunk: only it carries reasoning_content.
    body = {**responses.delta_chunk(job.meta, delta), "model": model}
    if first:  # the role comes with the first delta, as OpenAI sends it
        body["choices"][0]["delta"]["role"] = "assistant"
    return ModelResponseStream(**body)


def final_chunk(job: Completion) -> GenericStreamingChunk:
    # A GenericStreamingChunk on purpose: LiteLLM drops a content-less ModelResponseStream
    # after the finish reason, usage included, and would count tokens itself.
    counts = job.usage()
    return GenericStreamingChunk(
        text="",
        tool_use=None,
        is_finished=True,
        index=0,
        finish_reason=job.finish_reason or "stop",
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
