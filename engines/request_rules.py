"""What the MLX engine accepts and when a sequence ends (pure functions of a request)."""

from __future__ import annotations

import numpy as np

from mlxcel_plugin.engine_api import FINISH_LENGTH, FINISH_STOP, GenerationRequest, ModelInfo
from mlxcel_plugin.errors import ContextLengthError, InvalidRequestError

_TOKENS_PER_S_SMOOTHING = 0.2


def check_request(request: GenerationRequest, info: ModelInfo) -> None:
    """Raise a client error (4xx) for a request this model cannot serve."""
    n = len(request.prompt_tokens)
    if n == 0:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if request.max_tokens < 1:
        raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
    if n >= info.context_length:
        raise ContextLengthError(
            f"the prompt has {n} tokens; this model's context is {info.context_length} tokens",
            param="messages",
        )
    ids = np.asarray(request.prompt_tokens)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise InvalidRequestError("prompt tokens must be integer ids", param="prompt")
    if info.vocab_size and (ids.min() < 0 or ids.max() >= info.vocab_size):
        raise InvalidRequestError("prompt token id out of range", param="prompt")


def finish_reason(
    request: GenerationRequest, info: ModelInfo, token: int, num_generated: int
) -> str | None:
    """Why the request ends with ``token`` (its ``num_generated``-th), or None."""
    if token in info.eos_token_ids or token in request.stop_token_ids:
        return FINISH_STOP
    if num_generated >= request.max_tokens:
        return FINISH_LENGTH
    # The next step would need a position past the model's context.
    if len(request.prompt_tokens) + num_generated >= info.context_length:
        return FINISH_LENGTH
    return None


class SpeedMeter:
    """Decode tokens per second, exponentially smoothed."""

    def __init__(self) -> None:
        self.tokens_per_s = 0.0

    def record(self, tokens: int, elapsed_s: float) -> None:
        rate = tokens / max(elapsed_s, 1e-9)
        if self.tokens_per_s == 0:
            self.tokens_per_s = rate
            return
        a = _TOKENS_PER_S_SMOOTHING
        self.tokens_per_s = (1 - a) * self.tokens_per_s + a * rate
