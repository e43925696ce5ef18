"""The rejection rule of speculative sampling, for proposals drawn from a draft's distribution.

A proposal ``x`` drawn from the draft's ``q`` is kept with probability
``min(1, p(x) / q(x))`` (``p``: the target's distribution for that row); otherwise the
row's token is drawn from ``max(0, p - q)``, normalized. Whatever ``q`` is, the token
that comes out is distributed as ``p`` (Leviathan et al. 2023, Chen et al. 2023).
Pure numpy, randomness passed in.
"""

from __future__ import annotations

import numpy as np


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One categorical draw from (unnormalized) ``probs``, as the engine's sampler draws."""
    cumulative = np.cumsum(probs)
    return int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``max(0, p - q)``: where the target wants more than the draft offered."""
    rest = np.maximum(p - q, 0.0)
    return rest if rest.sum() > 0 else p  # p == q: a rejection cannot happen, keep p valid


def verify_proposal(p: np.ndarray, q: np.ndarray, proposal: int,
                    rng: np.random.Generator) -> int:
    """The row's token: ``proposal`` if kept, else a draw from the residual (never ``proposal``)."""
    if rng.random() * q[proposal] < p[proposal]:  # u < p/q without dividing by a tiny q
        return proposal
    return draw(residual(p, q), rng)
