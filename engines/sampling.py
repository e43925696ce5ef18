"""Per-sequence token sampling on one row of logits (numpy, float32).

Seeded sampling draws from ``numpy.random.default_rng((seed, position))``: a
pure function of the seed and the absolute position of the sampled token, so a
first token sampled on a prefill node and the rest on a decode node give the
same tokens as one node. Sampling one row at a time also keeps a sequence's
tokens independent of whatever else shares its decode batch.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from mlxcel_plugin.engine_api import SamplingParams
from mlxcel_plugin.logprobs import TokenLogprobs, token_logprobs

_UINT64 = (1 << 64) - 1


def has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def apply_penalties(logits: np.ndarray, counts: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Repetition (CTRL-style, as mlx-lm), presence and frequency penalties over ``counts``."""
    seen = counts > 0
    out = logits.copy()
    if params.repetition_penalty != 1.0:
        p = np.float32(params.repetition_penalty)
        out[seen] = np.where(out[seen] < 0, out[seen] * p, out[seen] / p)
    if params.presence_penalty != 0.0:
        out[seen] -= np.float32(params.presence_penalty)
    if params.frequency_penalty != 0.0:
        out -= np.float32(params.frequency_penalty) * counts.astype(np.float32)
    return out


def _top_k(logits: np.ndarray, k: int) -> np.ndarray:
    if k <= 0 or k >= logits.size:
        return logits
    kth = np.partition(logits, -k)[-k]
    return np.where(logits >= kth, logits, -np.inf)


def _min_p(probs: np.ndarray, min_p: float) -> np.ndarray:
    if min_p <= 0.0:
        return probs
    return np.where(probs >= probs.max() * min_p, probs, 0.0)


def _top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    if top_p >= 1.0:
        return probs
    order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    # Keep the smallest prefix whose mass reaches top_p (always at least one token).
    cutoff = int(np.searchsorted(cumulative, top_p * cumulative[-1])) + 1
    kept = np.zeros_like(probs)
    kept[order[:cutoff]] = probs[order[:cutoff]]
    return kept


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits.astype(np.float64) - np.max(logits))
    return shifted / shifted.sum()


def sampling_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """What a non-greedy draw samples from: temperature, top-k, min-p, top-p (unnormalized)."""
    scaled = _top_k(logits.astype(np.float32) / np.float32(params.temperature), params.top_k)
    return _top_p(_min_p(_softmax(scaled), params.min_p), params.top_p)


def sample_from_logits(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Temperature, top-k, min-p, top-p, then one categorical draw."""
    if params.is_greedy:
        return int(np.argmax(logits))
    probs = sampling_probs(logits, params)
    cumulative = np.cumsum(probs)
    return int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))


def position_rng(seed: int, position: int) -> np.random.Generator:
    """The generator for the token at absolute ``position`` of a request seeded with ``seed``."""
    return np.random.default_rng((seed & _UINT64, position))


class LogitsConstraint(Protocol):
    """Which tokens may come next (constrained decoding: engines/grammar.py)."""

    def mask(self, logits: np.ndarray) -> np.ndarray: ...  # refused tokens at -inf, a new row

    def advance(self, token: int) -> None: ...


class TokenSampler:
    """Sampling state of one sequence: its params, penalty context and randomness."""

    def __init__(
        self, params: SamplingParams, context: list[int] | tuple[int, ...], vocab_size: int,
        constraint: LogitsConstraint | None = None,
    ):
        self.params = params
        self.constraint = constraint  # applied before penalties; logprobs stay raw
        self._unseeded_rng = np.random.default_rng() if params.seed is None else None
        # Token counts over prompt + generated tokens, only when a penalty needs them.
        self._counts: np.ndarray | None = None
        if has_penalties(params):
            self._counts = np.bincount(np.asarray(context, dtype=np.int64), minlength=vocab_size)

    def _rng(self, position: int) -> np.random.Generator:
        if self._unseeded_rng is not None:
            return self._unseeded_rng
        return position_rng(self.params.seed, position)

    def sample(self, logits: np.ndarray, position: int) -> int:
        """The token at absolute ``position`` (= tokens before it) from its logits row."""
        return sample_from_logits(self._processed(logits), self.params, self._rng(position))

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution ``sample`` draws from (non-greedy), normalized: speculative/."""
        probs = sampling_probs(self._processed(logits), self.params)
        return probs / probs.sum()

    def _processed(self, logits: np.ndarray) -> np.ndarray:
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        if self._counts is not None:
            logits = apply_penalties(logits[: self._counts.size], self._counts, self.params)
        return logits

    def logprobs(self, logits: np.ndarray, token: int) -> TokenLogprobs | None:
        """The sampled ``token``'s logprobs from the raw ``logits`` row, when the request asked.

        Raw: before penalties, temperature and truncation (mlxcel_plugin/logprobs.py).
        """
        top = self.params.logprobs
        return None if top is None else token_logprobs(logits, token, top)

    def observe(self, token: int) -> None:
        """Add a generated token to the penalty context (and the constraint's state)."""
        if self.constraint is not None:
            self.constraint.advance(token)
        if self._counts is not None and 0 <= token < self._counts.size:
            self._counts[token] += 1
