"""LeastLoaded: lowest queue depth + active sequences + router in-flight."""

from __future__ import annotations

import random
from collections.abc import Sequence

from mlxcel_plugin.balancer_api import (
    NodeView,
    RequestInfo,
    choose_among_ties,
    healthy_nodes,
    least_loaded,
)


class LeastLoadedBalancer:
    """Picks the healthy node with the lowest ``NodeView.load``; ties by RNG."""

    name = "least-loaded"

    def __init__(self, rng: random.Random | None = None):
        self._rng = rng if rng is not None else random.Random()

    def select(self, candidates: Sequence[NodeView], request: RequestInfo) -> NodeView:
        return choose_among_ties(least_loaded(healthy_nodes(candidates)), self._rng)
