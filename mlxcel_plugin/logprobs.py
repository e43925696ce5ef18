"""Token log-probabilities as engines report them and links carry them (pure, numpy).

What they are (docs/protocol.md, "Logprobs"): the model's own distribution,
``log_softmax`` of the raw logits of the position, before penalties,
temperature, top-k/p or min-p (vLLM's default, ``raw_logprobs``; what
loglikelihood evaluation needs, and independent of how the token was drawn).

``TokenLogprobs``: one sampled token's logprob and the ``top`` most likely
tokens (most likely first, ties by lower id). ``PromptLogprobs``: the same for
prompt positions 1..n-1 (position 0 has nothing before it), as arrays; on a
link they travel as a RESULT frame's body (float32 / uint32, little-endian).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlxcel_plugin.errors import MlxcelError

# OpenAI's bound for chat ``top_logprobs``; completions allow 5.
MAX_TOP_LOGPROBS = 20
# Top-k candidates sorted per row at most (more only when values tie at the cut).
MAX_CANDIDATES = 512
_F32 = np.dtype("<f4")
_U32 = np.dtype("<u4")


class LogprobsMalformed(MlxcelError):
    """Logprobs from a peer that do not have the shape the protocol gives them."""

    code = "frame_malformed"


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def to_wire(self) -> list[Any]:
        return [self.logprob, list(self.top_ids), list(self.top_logprobs)]

    @classmethod
    def from_wire(cls, value: Any) -> TokenLogprobs:
        if not (isinstance(value, list | tuple) and len(value) == 3):
            raise LogprobsMalformed("a token's logprobs must be [logprob, top_ids, top_logprobs]")
        logprob, ids, values = value
        if not (isinstance(ids, list | tuple) and isinstance(values, list | tuple)
                and len(ids) == len(values) <= MAX_TOP_LOGPROBS):
            raise LogprobsMalformed("top_ids and top_logprobs must be lists of one length")
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise LogprobsMalformed("top_ids must be token ids")
        return cls(_logprob(logprob), tuple(ids), tuple(_logprob(v) for v in values))


def _logprob(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LogprobsMalformed("a logprob must be a number")
    number = float(value)
    if math.isnan(number) or number > 0.0:
        raise LogprobsMalformed(f"a logprob must be <= 0, got {number!r:.30}")
    return number


def tokens_to_wire(logprobs: Sequence[TokenLogprobs]) -> list[list[Any]]:
    return [item.to_wire() for item in logprobs]


def tokens_from_wire(value: Any, token_count: int) -> tuple[TokenLogprobs, ...]:
    """A RESULT's ``logprobs``: absent (None) or one entry per token id."""
    if value is None:
        return ()
    if not isinstance(value, list | tuple) or len(value) != token_count:
        raise LogprobsMalformed(f"logprobs must hold one entry per token ({token_count})")
    return tuple(TokenLogprobs.from_wire(item) for item in value)


@dataclass(frozen=True, eq=False)
class PromptLogprobs:
    """Prompt positions 1..n-1: ``logprobs[i]`` is token i+1's given tokens 0..i."""

    logprobs: np.ndarray  # float32 [n-1]
    top_ids: np.ndarray  # uint32 [n-1, top]
    top_logprobs: np.ndarray  # float32 [n-1, top]

    @property
    def top(self) -> int:
        return int(self.top_ids.shape[1])

    def __len__(self) -> int:
        return int(self.logprobs.shape[0])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PromptLogprobs):
            return NotImplemented
        return self.to_body() == other.to_body() and self.top == other.top

    def token(self, i: int) -> TokenLogprobs:
        """Prompt token ``i + 1``'s logprobs, as a generated token's would read."""
        return TokenLogprobs(float(self.logprobs[i]), tuple(self.top_ids[i].tolist()),
                             tuple(self.top_logprobs[i].tolist()))

    def to_body(self) -> bytes:
        return b"".join([np.ascontiguousarray(self.logprobs, _F32).tobytes(),
                         np.ascontiguousarray(self.top_ids, _U32).tobytes(),
                         np.ascontiguousarray(self.top_logprobs, _F32).tobytes()])

    @classmethod
    def from_body(cls, body: Any, top: int) -> PromptLogprobs:
        data = memoryview(body).cast("B")
        if not 0 <= top <= MAX_TOP_LOGPROBS or len(data) % (4 + 8 * top):
            raise LogprobsMalformed(f"a prompt logprobs body of {len(data)} bytes for top {top}")
        n = len(data) // (4 + 8 * top)
        logprobs = np.frombuffer(data, _F32, n, 0)
        ids = np.frombuffer(data, _U32, n * top, 4 * n).reshape(n, top)
        values = np.frombuffer(data, _F32, n * top, 4 * n + 4 * n * top).reshape(n, top)
        if np.isnan(logprobs).any() or (logprobs > 0).any() or (values > 0).any():
            raise LogprobsMalformed("prompt logprobs must be <= 0")
        return cls(logprobs.astype(np.float32), ids.astype(np.uint32), values.astype(np.float32))

    @classmethod
    def concatenate(cls, parts: Sequence[PromptLogprobs], top: int) -> PromptLogprobs:
        if not parts:
            empty = np.zeros((0, top), np.float32)
            return cls(np.zeros(0, np.float32), empty.astype(np.uint32), empty)
        return cls(np.concatenate([p.logprobs for p in parts]),
                   np.concatenate([p.top_ids for p in parts]),
                   np.concatenate([p.top_logprobs for p in parts]))


def logprob_rows(logits: np.ndarray, targets: Sequence[int], top: int) -> PromptLogprobs:
    """Rows of raw logits ``[n, vocab]`` → each target's logprob and the ``top`` best.

    float32 logits, exp in float32 after subtracting the row's max, the sum in
    float64: one function for every row an engine reports, so the same logits
    give the same numbers on any node.
    """
    x = np.asarray(logits, dtype=np.float32).reshape(len(targets), -1)
    peak = x.max(axis=1, keepdims=True)
    shifted = x - peak
    lse = np.log(np.exp(shifted).sum(axis=1, dtype=np.float64)).astype(np.float32)[:, None]
    rows = np.arange(len(targets))
    chosen = (shifted[rows, np.asarray(targets, dtype=np.int64)] - lse[:, 0]).astype(np.float32)
    if top <= 0:
        none = np.zeros((len(targets), 0), np.float32)
        return PromptLogprobs(chosen, none.astype(np.uint32), none)
    ids = _top_ids(x, min(top, x.shape[1]))
    order = np.argsort(-np.take_along_axis(x, ids, axis=1), axis=1, kind="stable")
    ids = np.take_along_axis(ids, order, axis=1)
    values = (np.take_along_axis(shifted, ids, axis=1) - lse).astype(np.float32)
    return PromptLogprobs(chosen, ids.astype(np.uint32), values)


def _top_ids(x: np.ndarray, top: int) -> np.ndarray:
    """Each row's ``top`` largest ids, ascending by id (of equal values the lower ids win)."""
    return np.stack([np.sort(_row_top(row, top)) for row in x])


def _row_top(row: np.ndarray, top: int) -> np.ndarray:
    """A row's ``top`` best, exactly, without partitioning the whole vocabulary.

    Every value at or above a threshold ``t`` is a candidate; once at least ``top`` are,
    the best ``top`` are among them (ties included). Choosing ``t`` costs a few
    comparison passes; sorting a few hundred candidates is cheap next to an
    ``argpartition`` of the vocabulary (~0.5 ms for 49k entries on one core).
    """
    peak, delta = float(row.max()), 4.0
    for _ in range(64):  # bounded: delta doubles or halves each time
        count = int(np.count_nonzero(row >= peak - delta))
        if count < top:
            delta *= 2.0
        elif count > MAX_CANDIDATES and delta > 1e-3:
            delta /= 2.0
        else:
            break
    candidates = np.flatnonzero(row >= peak - delta)
    if len(candidates) < top:  # a row spanning more than 2**64 (never for finite logits)
        candidates = np.arange(row.size)
    order = np.lexsort((candidates, -row[candidates]))[:top]  # by value, then by id
    return candidates[order]


def token_logprobs(logits: np.ndarray, token: int, top: int) -> TokenLogprobs:
    """One row of raw logits → the sampled ``token``'s logprobs (``logprob_rows`` of one)."""
    return logprob_rows(logits, [token], top).token(0)
