"""The router's ``TokenBackend``: admission, node selection, one ``RoutedRequest`` per request.

Per request (docs/cluster-flow.md, "One request on the router"): ``stream``
admits the request (admit, queue or 503), then hands it to a ``RoutedRequest``
(``routed_request.py``) with the ``RoutingContext`` built once here: the
selection function (balancers over the pool's views, one re-probe of
unreachable nodes), the pool, the stats sink and the re-route limit. The routed
request places it (REQUEST on a prefill node ``P`` with ``decode_target`` =
decode node ``D``, CLAIM on ``D``), merges both result streams and yields
``TokenEvent`` batches; when the stream closes, it cancels what still runs and
counts the outcome, and the backend lets the next queued request in.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mlxcel_plugin.balancer_api import Balancer, RequestInfo
from mlxcel_plugin.config import dataclass_from_mapping
from mlxcel_plugin.engine_api import GenerationRequest, TokenEvent
from mlxcel_plugin.errors import NoHealthyNodeError
from router_plugin.cluster.admission import ADMIT, REJECT, AdmissionController, pool_utilization
from router_plugin.cluster.health import HealthMonitor
from router_plugin.cluster.migration import (
    DEFAULT_MAX_MIGRATIONS,
    DEFAULT_MIGRATION_WAIT_S,
    DEFAULT_TOKEN_TIMEOUT_S,
)
from router_plugin.cluster.peer_links import PeerLink, PeerLinks
from router_plugin.cluster.prefix_index import DEFAULT_BLOCK_TOKENS
from router_plugin.cluster.routed_request import RoutedRequest
from router_plugin.cluster.routing_context import RoutingContext
from router_plugin.cluster.stats import RouterStats
from router_plugin.cluster.stream_bridge import DECODE, PREFILL


@dataclass(frozen=True)
class RouterConfig:
    """TOML section ``[router]``."""

    seed: int = 0  # feeds the balancers' RNGs
    max_placements: int = 3  # first placement + re-routes, per request
    # Mid-stream migrations per request (docs/cluster-flow.md, "Migration").
    max_migrations: int = DEFAULT_MAX_MIGRATIONS
    # Once streaming, this long without a token migrates the request; 0 turns it off.
    token_timeout_s: float = DEFAULT_TOKEN_TIMEOUT_S
    # A moving request, or one re-routed before its first token whose failed node is gone
    # too, with no healthy pair left waits this long for a node to come back (one dropped
    # for silence redials at once) before it ends with an error; 0: at once.
    migration_wait_s: float = DEFAULT_MIGRATION_WAIT_S
    # The prefix index's block: the nodes' prefill chunk ([engine] chunk_size_tokens).
    prefix_block_tokens: int = DEFAULT_BLOCK_TOKENS

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> RouterConfig:
        return dataclass_from_mapping(cls, section, "[router]")


class ClusterBackend:
    def __init__(self, peers: PeerLinks, health: HealthMonitor,
                 balancers: Mapping[str, Balancer], admission: AdmissionController,
                 stats: RouterStats, *, config: RouterConfig = RouterConfig(),
                 local_prefill_tokens: int = 0,
                 clock: Callable[[], float] = time.monotonic):
        self.peers, self.pool, self.health = peers, peers.pool, health
        self.balancers, self.admission, self.stats = balancers, admission, stats
        self.config, self.clock = config, clock
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self._node_changes: set[asyncio.Event] = set()  # wait_for_nodes' pending waits
        # All a routed request sees of the router: it never calls back into the backend.
        self.routing = RoutingContext(select=self.select, pool=self.pool, stats=stats,
                                      on_load_change=self.on_load_change,
                                      max_placements=config.max_placements,
                                      local_prefill_tokens=local_prefill_tokens,
                                      clock=clock, max_migrations=config.max_migrations,
                                      token_timeout_s=config.token_timeout_s,
                                      migration_wait_s=config.migration_wait_s,
                                      wait_for_nodes=self.wait_for_nodes)
        peers.set_on_change(self.on_load_change)

    # ------------------------------------------------------------ TokenBackend

    def is_ready(self) -> bool:
        now = self.clock()
        return all(any(v.healthy for v in self.pool.views(role, now))
                   for role in (PREFILL, DECODE))

    async def stream(self, request: GenerationRequest) -> AsyncIterator[list[TokenEvent]]:
        await self._admit(request)
        routed = RoutedRequest(self.routing, request)
        try:
            async for batch in routed.events():
                yield batch
        finally:
            await routed.close()
            self.on_load_change()

    # ------------------------------------------------------------ admission

    def utilization(self, now: float) -> float | None:
        """The busier of the two pools; None when either has no healthy node."""
        capacity = self.admission.config.node_capacity_requests
        levels = [pool_utilization(self.pool.views(role, now), capacity)
                  for role in (PREFILL, DECODE)]
        return None if None in levels else max(levels)

    async def _admit(self, request: GenerationRequest) -> None:
        now = self.clock()
        decision = self.admission.decide(request.request_id, len(request.prompt_tokens),
                                         self.utilization(now), now)
        if decision.action == ADMIT:
            return
        if decision.action == REJECT:
            self.stats.requests.rejected += 1
            raise decision.to_error()
        self.stats.requests.queued += 1
        await self._wait_in_queue(request.request_id)

    async def _wait_in_queue(self, request_id: str) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = waiter
        try:
            async with asyncio.timeout(self.admission.config.queue_timeout_s):
                await waiter
        except TimeoutError:
            self.stats.requests.rejected += 1
            raise self.admission.timeout_error() from None
        finally:
            self._waiters.pop(request_id, None)
            self.admission.cancel(request_id)  # a no-op unless we leave the queue early

    def on_load_change(self) -> None:
        """Load dropped (a request ended, telemetry, a node came back): let one queued in.

        One at a time: the admitted request's dispatch raises the load, and its
        ``on_dispatch`` calls here again for the next one. Every ``wait_for_nodes`` wakes.
        """
        for changed in self._node_changes:
            changed.set()
        if not self._waiters:
            return
        now = self.clock()
        request_id = self.admission.pop_admittable(self.utilization(now), now)
        waiter = self._waiters.get(request_id) if request_id is not None else None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait_for_nodes(self, timeout_s: float) -> None:
        """Return once a node connects or its load or health changes, or after ``timeout_s``."""
        changed = asyncio.Event()
        self._node_changes.add(changed)
        try:
            async with asyncio.timeout(timeout_s):
                await changed.wait()
        except TimeoutError:
            pass  # the caller looks again, and gives up at its own deadline
        finally:
            self._node_changes.discard(changed)

    # ------------------------------------------------------------ selection

    async def select(self, role: str, info: RequestInfo, excluded: Collection[str],
                     blocks: Sequence[int] = ()) -> PeerLink:
        """A healthy node of ``role``; re-probes unreachable ones once before giving up.

        ``blocks``: the prompt's prefix keys, so balancers see what each node holds.
        """
        try:
            return self._select(role, info, excluded, blocks)
        except NoHealthyNodeError:
            if not set(self.pool.probe_candidates(role)) - set(excluded):
                raise
        await self.health.reprobe(role)
        return self._select(role, info, excluded, blocks)

    def _select(self, role: str, info: RequestInfo, excluded: Collection[str],
                blocks: Sequence[int]) -> PeerLink:
        views = [v for v in self.pool.views(role, self.clock(), blocks, info.cache_key)
                 if v.node_id not in excluded]
        return self.peers[self.balancers[role].select(views, info).node_id]
