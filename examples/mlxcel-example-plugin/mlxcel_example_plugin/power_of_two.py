"""Power-of-two choices: sample two healthy nodes at random, keep the less loaded.

Why not always the least loaded? Load reports lag (telemetry arrives on an
interval), so every router that sees the same stale snapshot sends a burst to
the same "least loaded" node. Two random choices keep most of the benefit of
knowing the load (Mitzenmacher, "The Power of Two Choices in Randomized Load
Balancing") while spreading a burst over the pool.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from mlxcel_plugin.balancer_api import NodeView, RequestInfo, healthy_nodes


class PowerOfTwoBalancer:
    """``select`` samples two distinct healthy nodes and returns the one with lower load."""

    name = "power-of-two"

    def __init__(self, rng: random.Random | None = None):
        # Every draw comes from this RNG: the router seeds it, so a seed gives the same picks.
        self._rng = rng if rng is not None else random.Random()

    def select(self, candidates: Sequence[NodeView], request: RequestInfo) -> NodeView:
        # healthy_nodes sorts by id, so a seed gives the same picks whatever the input order.
        healthy = healthy_nodes(candidates)
        if len(healthy) == 1:
            return healthy[0]
        first, second = self._rng.sample(healthy, 2)
        # On a tie keep the first draw: it is already random, so ties spread too.
        return second if second.load < first.load else first
