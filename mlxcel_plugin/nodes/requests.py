"""Router frames → engine requests, with every field a peer controls checked (pure)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

from mlxcel_plugin.engine_api import GenerationRequest, SamplingParams
from mlxcel_plugin.errors import InvalidRequestError, MlxcelError
from mlxcel_plugin.link.protocol.frames import (
    AdapterCommand,
    Cancel,
    ErrorFrame,
    Frame,
    FrameError,
    FrameType,
    Request,
)

logger = logging.getLogger(__name__)

MAX_STOP_TOKEN_IDS = 1024
_INT_FIELDS = frozenset({"top_k", "seed", "logprobs", "prompt_logprobs",
                         "grammar_replay_tokens"})
_STR_FIELDS = frozenset({"grammar", "speculative"})  # structured_output.py, speculative/


def sampling_params(data: Mapping[str, Any]) -> SamplingParams:
    """Known sampling fields, type-checked; unknown keys (newer routers) are ignored."""
    values: dict[str, Any] = {}
    for spec in fields(SamplingParams):
        value = data.get(spec.name)
        if value is None:
            continue
        if spec.name in _STR_FIELDS:
            if not isinstance(value, str):
                raise InvalidRequestError(f"sampling.{spec.name} must be a string",
                                          param="sampling")
            values[spec.name] = value
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequestError(f"sampling.{spec.name} must be a number", param="sampling")
        if spec.name in _INT_FIELDS and not isinstance(value, int):
            raise InvalidRequestError(f"sampling.{spec.name} must be an integer", param="sampling")
        values[spec.name] = value if spec.name in _INT_FIELDS else float(value)
    return SamplingParams(**values)


def generation_request(frame: Request) -> GenerationRequest:
    if frame.max_tokens < 1:
        raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
    if len(frame.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError("too many stop_token_ids", param="stop_token_ids")
    if not frame.claim and not frame.prompt_token_ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    return GenerationRequest(
        request_id=frame.request_id,
        prompt_tokens=tuple(frame.prompt_token_ids),
        max_tokens=frame.max_tokens,
        sampling=sampling_params(frame.sampling),
        stop_token_ids=tuple(frame.stop_token_ids),
        adapter=frame.adapter,
    )


def dispatch_router_frame(
    frame: Frame,
    on_request: Callable[[Request], None],
    on_cancel: Callable[[str], None],
    reply: Callable[[Frame], None],
    admit: Callable[[Request], None] = lambda request: None,
    on_adapter: Callable[[AdapterCommand], None] | None = None,
) -> None:
    """One frame from a router link: REQUEST or CANCEL; a bad one gets a named ERROR frame.

    Both node kinds share this, so a router sees the same error codes from either.
    ``admit`` may refuse a REQUEST by raising (a draining node: ``nodes/drain.py``);
    ``on_adapter`` takes ADAPTER commands (``nodes/node_adapters.py``).
    """
    request_id = frame.header.get("request_id")
    request_id = request_id if isinstance(request_id, str) else None
    try:
        if frame.type is FrameType.REQUEST:
            request = Request.from_frame(frame)
            admit(request)
            on_request(request)
        elif frame.type is FrameType.CANCEL:
            on_cancel(Cancel.from_frame(frame).request_id)
        elif frame.type is FrameType.ADAPTER and on_adapter is not None:
            on_adapter(AdapterCommand.from_frame(frame))
        else:
            logger.debug("ignoring a %s frame from a router", frame.type.name)
    except (FrameError, MlxcelError) as exc:
        reply(ErrorFrame(exc.code or "error", exc.message, request_id).to_frame())
