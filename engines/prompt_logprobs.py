"""Prompt logprobs from the canonical chunked prefill (``prefill.run_prefill``'s hook).

``run_prefill`` hands each forward's logits to ``on_logits`` before evaluating
it; a ``PromptLogprobsCollector`` evaluates the rows that predict a prompt token
and keeps their logprobs (``mlxcel_plugin.logprobs.logprob_rows``), so hybrid and
prefill roles compute them from the same chunks. The last position predicts the
first generated token, not a prompt token: ``run_prefill`` does not report
that forward, and streams its layers as before.

A prefix-cache hit skips the cached positions' forwards, and their logits with
them, so a request that asks prompt logprobs prefills without reuse (exact, at
the cost of the full prefill); see ``prefill.prefill_request``.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from mlxcel_plugin.engine_api import GenerationRequest
from mlxcel_plugin.logprobs import PromptLogprobs, logprob_rows


class PromptLogprobsCollector:
    """``on_logits(start, logits)`` for ``run_prefill``; ``result()`` once it returned."""

    def __init__(self, tokens: Sequence[int], top: int):
        self.tokens = tuple(tokens)
        self.top = top
        self._parts: list[PromptLogprobs] = []
        self._next = 0  # the first position not reported yet

    def __call__(self, start: int, logits: mx.array) -> None:
        """``logits`` ``[1, n, vocab]`` (lazy) of positions ``start .. start + n - 1``."""
        if start != self._next:
            raise ValueError(f"prefill logits from {start}, expected {self._next}")
        width = int(logits.shape[1])
        self._next = start + width
        targets = self.tokens[start + 1 : start + width + 1]
        rows = np.array(logits[0, : len(targets)].astype(mx.float32))
        self._parts.append(logprob_rows(rows, targets, self.top))

    def result(self) -> PromptLogprobs:
        if self._next != len(self.tokens) - 1:
            raise ValueError(f"prefill logits up to {self._next} of {len(self.tokens) - 1}")
        return PromptLogprobs.concatenate(self._parts, self.top)


def prompt_logprobs_collector(request: GenerationRequest) -> PromptLogprobsCollector | None:
    """A collector for a request that asked prompt logprobs; None for every other."""
    top = request.sampling.prompt_logprobs
    return None if top is None else PromptLogprobsCollector(request.prompt_tokens, top)
