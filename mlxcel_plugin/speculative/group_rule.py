"""How deep a batch group verifies: each sequence's expected gain against the group's cost.

A verify forward feeds every sequence of a group as many rows as the group's widest
block (``engines/speculative/verify.py``), so one sequence proposing 4 tokens makes
its neighbours compute 4 padded rows too. With ``row_cost`` the cost of one more row
as a fraction of a one-row forward, a forward of ``r`` rows costs ``1 + row_cost *
(r - 1)``; a group of ``n`` sequences at width ``w`` computes ``n * w`` rows. The group
verifies at the width with the most expected tokens per cost, so where few of its
sequences repeat themselves speculation stops costing more than it gains. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxcel_plugin.speculative.adaptive import MIN_GAIN, expected_tokens


def forward_cost(rows: int, row_cost: float) -> float:
    """A forward of ``rows`` rows, in one-row forwards."""
    return 1.0 + row_cost * (rows - 1)


def group_width(rates: Sequence[float], offered: Sequence[int], row_cost: float) -> int:
    """Rows per sequence (1 + most proposals) for a group; 1: a plain step.

    ``rates[i]``: sequence i's acceptance rate; ``offered[i]``: the proposals it would
    verify (0 for a plain sequence). Sequence i then verifies ``min(offered[i], w - 1)``.
    """
    n = len(rates)

    def speed(width: int) -> float:
        tokens = sum(expected_tokens(rate, min(k, width - 1))
                     for rate, k in zip(rates, offered, strict=True))
        return tokens / forward_cost(n * width, row_cost)

    widest = 1 + max(offered, default=0)
    best = max(range(1, widest + 1), key=lambda w: (speed(w), -w))
    return best if speed(best) >= MIN_GAIN * speed(1) else 1  # as adaptive.best_k


def capped(offered: Sequence[int], width: int) -> list[int]:
    """Each sequence's proposals at ``width`` rows."""
    return [min(k, width - 1) for k in offered]
