"""MemoryAware: the most free KV memory; ties go to the least loaded."""

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


class MemoryAwareBalancer:
    """Highest ``free_kv_fraction``, then lowest load, then RNG.

    Meant for the decode pool, where KV memory (not compute) bounds how many
    sequences a node can hold.
    """

    name = "memory-aware"

    def __init__(self, rng: random.Random | None = None):
        self._rng = rng if rng is not None else random.Random()

    def select(self, candidates: Sequence[NodeView], request: RequestInfo) -> NodeView:
        healthy = healthy_nodes(candidates)
        most_free = max(node.free_kv_fraction for node in healthy)
        roomiest = [node for node in healthy if node.free_kv_fraction == most_free]
        return choose_among_ties(least_loaded(roomiest), self._rng)
