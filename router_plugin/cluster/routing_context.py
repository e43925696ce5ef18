"""What a routed request needs from the router, passed in once and shared by all requests.

A ``RoutedRequest`` (``routed_request.py``) never sees the ``ClusterBackend``: node
selection, the pool's dispatch counts, the stats sink, the admission wake-up, the
limits, and a way to wait for the nodes to change all come in this context.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass

from mlxcel_plugin.balancer_api import RequestInfo
from router_plugin.cluster.migration import DEFAULT_MAX_MIGRATIONS, DEFAULT_TOKEN_TIMEOUT_S
from router_plugin.cluster.node_pool import NodePool
from router_plugin.cluster.peer_links import PeerLink
from router_plugin.cluster.stats import RouterStats

# (role, request, excluded node ids, prompt prefix keys) -> a healthy node of that role
SelectNode = Callable[[str, RequestInfo, Collection[str], Sequence[int]], Awaitable[PeerLink]]


async def _no_wait(timeout_s: float) -> None:
    """A context without a router behind it (tests): nothing will change, so the wait runs
    out (returning at once would make a positive ``migration_wait_s`` a busy loop)."""
    await asyncio.sleep(max(timeout_s, 0.0))


@dataclass(frozen=True)
class RoutingContext:
    """Built once by the ``ClusterBackend``; every routed request reads the same one."""

    select: SelectNode  # the balancers' pick, re-probing unreachable nodes once
    pool: NodePool  # dispatch/finish counts, which the balancers read
    stats: RouterStats
    on_load_change: Callable[[], None]  # a dispatch changed the load: admission may act
    max_placements: int  # first placement + re-routes
    # A decode node believed to hold all but this many prompt tokens prefills them itself.
    local_prefill_tokens: int = 0
    clock: Callable[[], float] = time.monotonic  # for the pool's telemetry ages
    max_migrations: int = DEFAULT_MAX_MIGRATIONS  # moves after the client saw a token
    token_timeout_s: float = DEFAULT_TOKEN_TIMEOUT_S  # once streaming, silence migrates; 0: off
    # A moving (or re-routed) request with no healthy pair left waits this long for a node.
    migration_wait_s: float = 0.0
    wait_for_nodes: Callable[[float], Awaitable[None]] = _no_wait  # returns on a change
