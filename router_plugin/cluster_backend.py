"""The router's ``TokenBackend``: one request across a prefill node and a decode node.

Per request (docs/cluster-flow.md): admission (admit, queue or 503) → the
balancers pick a prefill node ``P`` and a decode node ``D`` from the pool's
views → REQUEST on ``P`` with ``decode_target`` = ``D``'s address → CLAIM on
``D`` (a REQUEST frame with ``claim=True``) → RESULT frames from both links
merge in a ``StreamBridge`` (seq 0 from ``P``, 1, 2, ... from ``D``) → one
``TokenEvent`` per token, ``index`` = seq; everything that arrived by the time
the front asks goes out as one batch.

Faults: a node lost (or at capacity) before the client saw a token → the
request is placed again (a new wire id, so late frames of the old attempt
cannot leak in; the old claim is cancelled); ``D`` lost mid-stream → one error
event, then the stream ends; ``P`` lost after seq 0 → ``D`` carries on (it
errors the claim itself if the KV never arrives). The iterator closed early
(client gone, stop string) → CANCEL to whichever side is still working.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from mlxcel_plugin.config import dataclass_from_mapping
from mlxcel_plugin.engine_api import FINISH_ERROR, GenerationRequest, TokenEvent
from mlxcel_plugin.errors import (
    AtCapacityError,
    ContextLengthError,
    InvalidRequestError,
    NodeLostError,
    NoHealthyNodeError,
)
from mlxcel_plugin.link.protocol.frames import Request
from router_plugin.admission import ADMIT, REJECT, AdmissionController, pool_utilization
from router_plugin.backend import next_batch
from router_plugin.balancers.base import Balancer, RequestInfo
from router_plugin.health import HealthMonitor
from router_plugin.peer_links import PeerEvent, PeerLink, PeerLinks
from router_plugin.stats import RouterStats
from router_plugin.stream_bridge import (
    DECODE,
    PREFILL,
    BridgeOutput,
    ResultEvent,
    StreamBridge,
)

logger = logging.getLogger(__name__)

AT_CAPACITY_CODES = frozenset({AtCapacityError.code, NoHealthyNodeError.code})
# A node's refusal that is the client's fault: the same 400 a single node would give.
CLIENT_ERRORS: dict[str, type[InvalidRequestError]] = {
    InvalidRequestError.code: InvalidRequestError,
    ContextLengthError.code: ContextLengthError,
    "prompt_too_long": ContextLengthError,
}


@dataclass(frozen=True)
class RouterConfig:
    """TOML section ``[router]``."""

    seed: int = 0  # feeds the balancers' RNGs
    max_placements: int = 3  # first placement + re-routes, per request

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> RouterConfig:
        return dataclass_from_mapping(cls, section, "[router]")


@dataclass
class Placement:
    """One routing attempt of a request: its wire id and the two nodes serving it."""

    attempt: int
    wire_id: str
    prefill: PeerLink
    decode: PeerLink
    # "done": that side holds nothing more for this attempt (finished, failed or gone).
    prefill_done: bool = False
    decode_done: bool = False

    def side(self, source: str) -> PeerLink:
        return self.prefill if source == PREFILL else self.decode


def wire_id(request_id: str, attempt: int) -> str:
    # A fresh id per attempt: frames of an abandoned attempt find no route.
    return request_id if attempt == 0 else f"{request_id}~{attempt}"


class ClusterBackend:
    def __init__(self, peers: PeerLinks, health: HealthMonitor,
                 balancers: Mapping[str, Balancer], admission: AdmissionController,
                 stats: RouterStats, *, config: RouterConfig = RouterConfig(),
                 clock: Callable[[], float] = time.monotonic):
        self.peers, self.pool, self.health = peers, peers.pool, health
        self.balancers, self.admission, self.stats = balancers, admission, stats
        self.config, self.clock = config, clock
        self._waiters: dict[str, asyncio.Future[None]] = {}
        peers.set_on_change(self.on_load_change)

    # ------------------------------------------------------------ TokenBackend

    def is_ready(self) -> bool:
        now = self.clock()
        return all(any(v.healthy for v in self.pool.views(role, now))
                   for role in (PREFILL, DECODE))

    async def stream(self, request: GenerationRequest) -> AsyncIterator[list[TokenEvent]]:
        await self._admit(request)
        routed = RoutedRequest(self, request)
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
        ``on_dispatch`` calls here again for the next one.
        """
        if not self._waiters:
            return
        now = self.clock()
        request_id = self.admission.pop_admittable(self.utilization(now), now)
        waiter = self._waiters.get(request_id) if request_id is not None else None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ------------------------------------------------------------ selection

    async def select(self, role: str, info: RequestInfo, excluded: Collection[str]) -> PeerLink:
        """A healthy node of ``role``; re-probes unreachable ones once before giving up."""
        try:
            return self._select(role, info, excluded)
        except NoHealthyNodeError:
            if not set(self.pool.probe_candidates(role)) - set(excluded):
                raise
        await self.health.reprobe(role)
        return self._select(role, info, excluded)

    def _select(self, role: str, info: RequestInfo, excluded: Collection[str]) -> PeerLink:
        views = [v for v in self.pool.views(role, self.clock()) if v.node_id not in excluded]
        return self.peers[self.balancers[role].select(views, info).node_id]


@dataclass
class RoutedRequest:
    """One request's run: placement, the merged result streams, and its cleanup."""

    backend: ClusterBackend
    request: GenerationRequest
    bridge: StreamBridge = field(default_factory=StreamBridge)
    inbox: asyncio.Queue[tuple[int, PeerEvent]] = field(default_factory=asyncio.Queue)
    placement: Placement | None = None
    excluded: set[str] = field(default_factory=set)
    index: int = 0  # completion index of the next token

    @property
    def stats(self) -> RouterStats:
        return self.backend.stats

    refused: bool = False  # answered 503: no node could take it

    def __post_init__(self) -> None:
        self.stats.requests.total += 1
        self.stats.active_prefills += 1

    async def events(self) -> AsyncIterator[list[TokenEvent]]:
        try:
            await self._place()
            while not self.bridge.complete:  # ends with the bridge's one terminal output
                batch: list[TokenEvent] = []
                for attempt, event in await next_batch(self.inbox):
                    if attempt != self.placement.attempt:
                        continue  # queued before a re-route; the attempt it belongs to is gone
                    for output in await self._on_event(event):
                        batch += self._token_events(output)
                if batch:
                    yield batch
        except AtCapacityError:
            self.refused = True  # raised before any token: the client gets 503 + Retry-After
            raise

    # ------------------------------------------------------------ placement

    async def _place(self) -> None:
        info = RequestInfo(self.request.request_id, len(self.request.prompt_tokens),
                           self.request.max_tokens)
        prefill = await self.backend.select(PREFILL, info, self.excluded)
        decode = await self.backend.select(DECODE, info, self.excluded)
        attempt = self.bridge.attempt
        placement = Placement(attempt, wire_id(self.request.request_id, attempt), prefill, decode)
        self.placement = placement
        for peer in (prefill, decode):
            peer.register(placement.wire_id, self._sink(attempt))
            self.backend.pool.on_dispatch(peer.node_id)
        self.backend.on_load_change()
        # REQUEST first: prefill is on the first token's path; D holds a KV that beats the claim.
        await self._send(placement, prefill, self._request_frame(placement))
        await self._send(placement, decode, self._claim_frame(placement))

    def _sink(self, attempt: int) -> Callable[[PeerEvent], None]:
        inbox = self.inbox
        return lambda event: inbox.put_nowait((attempt, event))

    async def _send(self, placement: Placement, peer: PeerLink, request: Request) -> None:
        try:
            await peer.send(request.to_frame())
        except NodeLostError as exc:
            # The link went down between selection and send; handle it like any loss.
            lost = PeerEvent(peer.role, peer.node_id, error=exc.message, lost=True)
            self.inbox.put_nowait((placement.attempt, lost))

    def _claim_frame(self, placement: Placement) -> Request:
        r = self.request
        return Request(placement.wire_id, [], r.sampling.to_dict(), r.max_tokens,
                       list(r.stop_token_ids), claim=True)

    def _request_frame(self, placement: Placement) -> Request:
        r = self.request
        return Request(placement.wire_id, list(r.prompt_tokens), r.sampling.to_dict(),
                       r.max_tokens, list(r.stop_token_ids),
                       decode_target=placement.decode.address)

    # ------------------------------------------------------------ events

    async def _on_event(self, event: PeerEvent) -> list[BridgeOutput]:
        placement = self.placement
        if event.source == DECODE:
            placement.prefill_done = True  # D has the KV (or P's part no longer matters)
        if event.lost or event.error is not None:
            self._side_done(event.source)
            return await self._on_failure(event)
        result = event.result
        if result.finish_reason is not None:
            self._side_done(event.source)
        # else a non-final seq 0 leaves P busy handing the KV to D: it is cancelled if we stop.
        return self._feed(ResultEvent(event.source, result.seq, tuple(result.token_ids),
                                      result.finish_reason, result.error, self.bridge.attempt))

    def _feed(self, result: ResultEvent) -> list[BridgeOutput]:
        had_token = self.bridge.emitted_any_token
        outputs = self.bridge.feed(result)
        if not had_token and self.bridge.emitted_any_token:
            self.stats.active_prefills -= 1
            self.stats.active_decodes += 1
        return outputs

    async def _on_failure(self, event: PeerEvent) -> list[BridgeOutput]:
        if self.bridge.can_reroute and self._worth_rerouting(event):
            await self._reroute(event.node_id)
            return []
        if event.lost and event.source == PREFILL and self.bridge.emitted_any_token:
            return []  # D owns the sequence now; it errors the claim if the KV never came
        if event.code in CLIENT_ERRORS and not self.bridge.emitted_any_token:
            raise CLIENT_ERRORS[event.code](f"{event.node_id} refused the request: {event.error}")
        if event.code in AT_CAPACITY_CODES and not self.bridge.emitted_any_token:
            raise AtCapacityError(f"{event.node_id} at capacity: {event.error}")
        if event.lost:
            return self.bridge.node_lost(event.source)
        return self.bridge.feed(ResultEvent(event.source, self.bridge.next_seq,
                                            error=event.error, attempt=self.bridge.attempt))

    def _worth_rerouting(self, event: PeerEvent) -> bool:
        if self.bridge.attempt + 1 >= self.backend.config.max_placements:
            return False
        return event.lost or event.code in AT_CAPACITY_CODES

    async def _reroute(self, failed_node_id: str) -> None:
        logger.info("re-routing %s: %s failed before its first token",
                    self.request.request_id, failed_node_id)
        self.excluded.add(failed_node_id)
        await self._release(self.placement, "rerouted")
        self.bridge.restart()
        self.stats.requests.rerouted += 1
        await self._place()

    def _side_done(self, source: str) -> None:
        placement = self.placement
        if source == PREFILL:
            placement.prefill_done = True
        else:
            placement.decode_done = True

    def _token_events(self, output: BridgeOutput) -> list[TokenEvent]:
        rid = self.request.request_id
        if not output.token_ids:
            return [TokenEvent(rid, self.index, None, output.finish_reason, output.error)]
        events = []
        last = len(output.token_ids) - 1
        for i, token_id in enumerate(output.token_ids):
            finish = output.finish_reason if i == last else None
            events.append(TokenEvent(rid, self.index, token_id, finish,
                                     output.error if finish else None))
            self.index += 1
        return events

    # ------------------------------------------------------------ cleanup

    async def close(self) -> None:
        """Cancel what still runs, free the routes, count the outcome."""
        if self.placement is not None:
            await self._release(self.placement, "client closed the stream")
        if self.bridge.emitted_any_token:
            self.stats.active_decodes -= 1
        else:
            self.stats.active_prefills -= 1
        self._count_outcome()

    async def _release(self, placement: Placement, reason: str) -> None:
        for source, done in ((PREFILL, placement.prefill_done), (DECODE, placement.decode_done)):
            peer = placement.side(source)
            peer.unregister(placement.wire_id)
            self.backend.pool.on_finish(peer.node_id)
            if not done:
                await peer.cancel(placement.wire_id, reason)

    def _count_outcome(self) -> None:
        counters = self.stats.requests
        if self.refused:
            counters.rejected += 1
        elif not self.bridge.complete:
            counters.closed_early += 1
        elif self.bridge.finish_reason == FINISH_ERROR:
            counters.failed += 1
        else:
            counters.completed += 1
