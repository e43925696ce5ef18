"""LeastLoaded: lowest queue depth + active sequences + router in-flight."""

from __future__ import annotations

import random
from collections.abc import Sequence

from router_plugin.balancers.base import (
    NodeView,
    RequestInfo,
    choose_among_ties,
    healthy_nodes,
    least_loaded,
)


class LeastLoadedBalancer:
    """Picks the healthy node with the lowest ``NodeView.load``; ties by RNG."""

    name = "least-loaded"

    def __init__(self, seed: int = 0):
        self._rng = random.Random(seed)

    def select(
        self,
        candidates: Sequence[NodeView],
        request: RequestInfo,
        rng: random.Random | None = None,
    ) -> NodeView:
        tied = least_loaded(healthy_nodes(candidates))
        return choose_among_ties(tied, rng if rng is not None else self._rng)
