"""The fake engine's logprobs: a pure function of context length, token and position.

So router-level tests see logprobs without MLX, and a cluster and a hybrid node
report the same ones. Every value is a multiple of 1/16 (exact in float32, as
prompt logprobs travel); the reported token is always the most likely one, so
loglikelihood clients read it as greedy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mlxcel_plugin.engine_api import GenerationRequest
from mlxcel_plugin.logprobs import PromptLogprobs, TokenLogprobs


def fake_logprobs(position: int, token: int, top: int, vocab_size: int) -> TokenLogprobs:
    """``token`` at absolute ``position``, and ``top`` alternatives (``token`` first)."""
    logprob = -(((position * 7 + token * 13) % 97) + 1) / 16
    ids = tuple((token + i) % vocab_size for i in range(top))
    return TokenLogprobs(logprob, ids, tuple(logprob - i / 2 for i in range(top)))


def token_logprobs(request: GenerationRequest, index: int, token: int | None,
                   vocab_size: int) -> TokenLogprobs | None:
    """Completion token ``index``'s logprobs when the request asked (None otherwise)."""
    top = request.sampling.logprobs
    if top is None or token is None:
        return None
    return fake_logprobs(len(request.prompt_tokens) + index, token, top, vocab_size)


def prompt_logprobs(request: GenerationRequest, vocab_size: int) -> PromptLogprobs | None:
    """Prompt positions 1..n-1 when the request asked (None otherwise)."""
    top = request.sampling.prompt_logprobs
    if top is None:
        return None
    rows = [fake_logprobs(i, t, top, vocab_size) for i, t in enumerate(request.prompt_tokens)]
    return _as_arrays(rows[1:], top)


def _as_arrays(rows: Sequence[TokenLogprobs], top: int) -> PromptLogprobs:
    ids = np.array([r.top_ids for r in rows], np.uint32).reshape(len(rows), top)
    values = np.array([r.top_logprobs for r in rows], np.float32).reshape(len(rows), top)
    return PromptLogprobs(np.array([r.logprob for r in rows], np.float32), ids, values)


def first_logprobs(request: GenerationRequest, token: int | None,
                   vocab_size: int) -> tuple[TokenLogprobs | None, PromptLogprobs | None]:
    """The first token's and the prompt's, as a prefill reports them."""
    return token_logprobs(request, 0, token, vocab_size), prompt_logprobs(request, vocab_size)
