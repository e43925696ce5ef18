"""The contract between the router and a balancer (built-in or third-party).

A balancer is one small object: a ``name`` (its registered config value) and
``select(candidates, request)`` returning one of the candidates. It is pure
and synchronous: no I/O, no logging, no clock; the caller logs and counts.

Its only source of randomness is the ``random.Random`` it is built with:
plugins register ``factory(rng: random.Random) -> Balancer`` through
``mlxcel_register_balancers``, and the router passes one seeded RNG per pool
(``[router] seed``), so a seed gives the same picks every run.

The helpers below (``healthy_nodes``, ``choose_among_ties``, ...) are what the
built-in balancers are made of; a plugin may use them too.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from mlxcel_plugin.errors import NoHealthyNodeError


@dataclass(frozen=True)
class NodeView:
    """A snapshot of one node as the router sees it at selection time.

    Telemetry fields hold the node's last report; the node pool resets them to
    these defaults when the report is stale, so a balancer never needs a clock.
    """

    node_id: str  # stable, e.g. "prefill-0"
    address: str
    healthy: bool = True
    in_flight: int = 0  # requests the router dispatched and has not seen finish
    queue_depth: int = 0
    active_sequences: int = 0
    free_kv_fraction: float = 1.0
    tokens_per_s: float = 0.0
    telemetry_age_s: float | None = None  # None: no fresh report
    # Prompt tokens of this request the router believes the node holds in its prefix
    # cache (the router's prefix index; 0 when unknown). Only a guess: a node lacking
    # them prefills them.
    cached_prefix_tokens: int = 0
    # The router last placed a request with this request's ``cache_key`` here.
    holds_cache_key: bool = False

    @property
    def load(self) -> int:
        # The router's own counter covers the gap until the next telemetry report.
        return self.queue_depth + self.active_sequences + self.in_flight


@dataclass(frozen=True)
class RequestInfo:
    """What a balancer may know about the request being placed."""

    request_id: str
    prompt_tokens: int
    max_tokens: int = 0
    cache_key: str | None = None  # the client's prompt_cache_key, a routing hint


@runtime_checkable
class Balancer(Protocol):
    name: str

    def select(self, candidates: Sequence[NodeView], request: RequestInfo) -> NodeView:
        """Pick one healthy candidate; raise ``NoHealthyNodeError`` if there is none."""
        ...


# ``factory(rng)``: every random draw the balancer makes comes from ``rng``.
BalancerFactory = Callable[[random.Random], Balancer]

_TRAILING_NUMBER = re.compile(r"^(.*?)(\d+)$")


def node_order_key(node: NodeView) -> tuple[str, int, str]:
    """Natural order of ids, so ``prefill-10`` comes after ``prefill-2``."""
    match = _TRAILING_NUMBER.match(node.node_id)
    if match is None:
        return (node.node_id, -1, node.node_id)
    return (match.group(1), int(match.group(2)), node.node_id)


def healthy_nodes(candidates: Sequence[NodeView]) -> list[NodeView]:
    """Healthy candidates in stable id order; raises when there are none."""
    healthy = sorted((node for node in candidates if node.healthy), key=node_order_key)
    if not healthy:
        raise NoHealthyNodeError(
            f"no healthy node among {len(candidates)} candidate(s)", retry_after_s=1.0
        )
    return healthy


def choose_among_ties(nodes: Sequence[NodeView], rng: random.Random) -> NodeView:
    """Break a tie with the RNG (spreads a burst instead of piling on the first id)."""
    if len(nodes) == 1:
        return nodes[0]
    return nodes[rng.randrange(len(nodes))]


def least_loaded(nodes: Sequence[NodeView]) -> list[NodeView]:
    lowest = min(node.load for node in nodes)
    return [node for node in nodes if node.load == lowest]
