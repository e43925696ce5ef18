"""PromptLengthAware: long prompts to the least loaded, short ones spread.

Rule:

* ``prompt_tokens >= long_prompt_tokens`` (long): the healthy node with the
  lowest load; ties go to the highest ``tokens_per_s`` (the most capable), then
  to the lowest id. A long prefill occupies a node for a long time, so it gets
  the emptiest one.
* otherwise (short): power of two choices: two distinct healthy nodes drawn
  with the RNG, the less loaded one wins (the first drawn on a tie). Short
  requests spread over the pool without herding onto the single emptiest node,
  which the next long prompt may need.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from mlxcel_plugin.balancer_api import NodeView, RequestInfo, healthy_nodes, least_loaded

DEFAULT_LONG_PROMPT_TOKENS = 2048


class PromptLengthAwareBalancer:
    name = "prompt-length-aware"

    def __init__(
        self,
        rng: random.Random | None = None,
        long_prompt_tokens: int = DEFAULT_LONG_PROMPT_TOKENS,
    ):
        if long_prompt_tokens < 1:
            raise ValueError(f"long_prompt_tokens must be >= 1, got {long_prompt_tokens}")
        self._rng = rng if rng is not None else random.Random()
        self.long_prompt_tokens = long_prompt_tokens

    def select(self, candidates: Sequence[NodeView], request: RequestInfo) -> NodeView:
        healthy = healthy_nodes(candidates)
        if request.prompt_tokens >= self.long_prompt_tokens:
            return _most_capable(least_loaded(healthy))
        return _power_of_two(healthy, self._rng)


def _most_capable(nodes: Sequence[NodeView]) -> NodeView:
    # max() keeps the first of equal values, and ``nodes`` is in stable id order.
    return max(nodes, key=lambda node: node.tokens_per_s)


def _power_of_two(nodes: Sequence[NodeView], rng: random.Random) -> NodeView:
    if len(nodes) == 1:
        return nodes[0]
    first, second = rng.sample(range(len(nodes)), 2)
    return nodes[second] if nodes[second].load < nodes[first].load else nodes[first]
