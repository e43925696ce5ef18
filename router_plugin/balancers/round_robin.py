"""RoundRobin: healthy nodes in stable id order, one after the other."""

from __future__ import annotations

import random
from collections.abc import Sequence

from mlxcel_plugin.balancer_api import NodeView, RequestInfo, healthy_nodes, node_order_key


class RoundRobinBalancer:
    """Picks the first healthy node whose id comes after the last one picked.

    Remembering the last id (not a position) keeps the rotation fair when nodes
    join, leave or turn unhealthy: nobody is skipped or picked twice in a row
    just because the list changed length.
    """

    name = "round-robin"

    def __init__(self, rng: random.Random | None = None):
        # The rotation needs no randomness; ``rng`` is accepted for the factory contract.
        self._last_key: tuple[str, int, str] | None = None

    def select(self, candidates: Sequence[NodeView], request: RequestInfo) -> NodeView:
        healthy = healthy_nodes(candidates)
        chosen = healthy[0]
        if self._last_key is not None:
            after = [node for node in healthy if node_order_key(node) > self._last_key]
            chosen = after[0] if after else healthy[0]
        self._last_key = node_order_key(chosen)
        return chosen
