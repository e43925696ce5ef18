"""PrefixAware: the node already holding most of the prompt, unless that overloads it.

Reusing a node's cached prefix saves prefilling it again (a chat's next turn,
a shared system prompt), but sending every request of a popular prefix to one
node would queue them behind each other. As SGLang's cache-aware policy does,
the pool counts as imbalanced when its busiest node carries both
``BALANCE_ABS_REQUESTS`` more and ``BALANCE_REL`` times the load of its idlest;
then load decides. Otherwise the longest cached prefix wins, provided that node
is within ``BALANCE_ABS_REQUESTS`` of the least loaded; ties and prompts no node
holds go to the node the client's ``prompt_cache_key`` last went to
(``NodeView.holds_cache_key``; only among nodes not overloaded), else to the
least loaded: the tokens are the truth, the key a hint.
``NodeView.cached_prefix_tokens`` is the router's guess of what each node holds
(router_plugin/cluster/prefix_index.py).
"""

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

BALANCE_ABS_REQUESTS = 4
BALANCE_REL = 1.5


def imbalanced(nodes: Sequence[NodeView]) -> bool:
    lowest, highest = min(n.load for n in nodes), max(n.load for n in nodes)
    return highest - lowest > BALANCE_ABS_REQUESTS and highest > BALANCE_REL * lowest


class PrefixAwareBalancer:
    """Longest cached prefix among nodes not overloaded; else least loaded; ties by RNG."""

    name = "prefix-aware"

    def __init__(self, rng: random.Random | None = None):
        self._rng = rng if rng is not None else random.Random()

    def select(self, candidates: Sequence[NodeView], request: RequestInfo) -> NodeView:
        healthy = healthy_nodes(candidates)
        if imbalanced(healthy):
            return choose_among_ties(least_loaded(healthy), self._rng)
        lowest = min(n.load for n in healthy)
        near = [n for n in healthy if n.load - lowest <= BALANCE_ABS_REQUESTS]
        best = max(n.cached_prefix_tokens for n in near)
        if best == 0:
            keyed = [n for n in near if n.holds_cache_key]
            return choose_among_ties(least_loaded(keyed or healthy), self._rng)
        holders = [n for n in near if n.cached_prefix_tokens == best]
        keyed = [n for n in holders if n.holds_cache_key]
        return choose_among_ties(least_loaded(keyed or holders), self._rng)
