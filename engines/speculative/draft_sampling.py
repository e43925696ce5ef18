"""Draft proposals for one sequence: the draft's pick, and the target's verdict on each.

Greedy and seeded requests propose the draft's argmax and keep it when the target's
own sampler picks it too (the rejection rule for a point-mass proposal: tokens are
exactly those of decoding without speculation). Unseeded sampled requests draw each
proposal from the draft's distribution ``q`` (the request's temperature, top-k/p,
min-p on the draft's logits) and the target keeps it by the rejection rule against
its own ``p`` (``mlxcel_plugin/speculative/rejection.py``): more proposals kept, and
the tokens are distributed as the target's. ``DraftVerifier`` takes a seed too (its
draws then come from (seed, position) streams of their own: the tests use that).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engines.decode_batch import Sequence
from engines.sampling import sampling_probs
from mlxcel_plugin.speculative.rejection import draw, verify_proposal

# Streams of a seeded request's (seed, position) that speculation draws from, apart from
# the plain sampler's own.
DRAFT_STREAM, VERIFY_STREAM = 1, 2
UINT64 = (1 << 64) - 1


def same_width(q: np.ndarray, size: int) -> np.ndarray:
    """``q`` over the target's vocabulary (a checkpoint may pad its rows differently)."""
    if q.size == size:
        return q
    out = np.zeros(size, dtype=q.dtype)
    out[: min(size, q.size)] = q[:size]
    return out


class DraftVerifier:
    """A sampled sequence's sampler while drafting: the rejection rule on proposed rows.

    Rows past the proposals (and steps without any) go to the plain sampler; every
    other attribute is the plain sampler's.
    """

    def __init__(self, inner: Any):
        self.inner = inner
        self._pending: list[tuple[int, np.ndarray]] = []  # this step's (proposal, q)
        self._unseeded = np.random.default_rng() if inner.params.seed is None else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def rng(self, position: int, stream: int) -> np.random.Generator:
        if self._unseeded is not None:
            return self._unseeded
        return np.random.default_rng((self.inner.params.seed & UINT64, position, stream))

    def propose(self, row: np.ndarray, position: int, first: bool) -> int:
        """Draw the proposal for ``position`` from the draft's ``row``; remember its ``q``."""
        if first:
            self._pending = []
        q = sampling_probs(row, self.inner.params)
        q = q / q.sum()
        token = draw(q, self.rng(position, DRAFT_STREAM))
        self._pending.append((token, q))
        return token

    def sample(self, logits: np.ndarray, position: int) -> int:
        if not self._pending:
            return self.inner.sample(logits, position)
        proposal, q = self._pending.pop(0)
        p = self.inner.probabilities(logits)
        token = verify_proposal(p, same_width(q, p.size), proposal,
                                self.rng(position, VERIFY_STREAM))
        if token != proposal:
            self._pending = []  # verification stops at the first rejection
        return token


def wrap_sampled(sequence: Sequence) -> None:
    """Give an unseeded sampled sequence the rejection rule on its drafted rows.

    Greedy and seeded sequences propose the draft's argmax instead: a point-mass
    proposal judged by the plain sampler, so each token stays the one the sampler
    draws at its position without speculation, whatever the step boundaries (a
    migrated or handed-off seeded stream continues with the same tokens).
    """
    sampling = sequence.request.sampling
    if sampling.is_greedy or sampling.seed is not None:
        return
    if not isinstance(sequence.sampler, DraftVerifier):
        sequence.sampler = DraftVerifier(sequence.sampler)


def choose_proposal(sequence: Sequence, index: int, row: np.ndarray) -> int:
    """Proposal ``index`` of this step from the draft's logits ``row``."""
    if isinstance(sequence.sampler, DraftVerifier):
        return sequence.sampler.propose(row, sequence.next_position + index, index == 0)
    return int(np.argmax(row))
