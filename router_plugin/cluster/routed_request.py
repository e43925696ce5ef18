"""One request's run across a prefill node and a decode node.

Its place in the whole path: docs/cluster-flow.md, "One request on the router".

A ``RoutedRequest`` owns everything the router holds for one request below the
text layer: its placements (attempts), the inbox its nodes' RESULT frames land
in, the ``StreamBridge`` merging them, and its outcome counters. What it needs
from the router comes in a ``RoutingContext`` (node selection, the pool's
dispatch counts, the stats sink, the admission wake-up, the re-route limit); it
never sees the ``ClusterBackend``. Read it top to bottom: ``events`` places the
request, then turns node events into ``TokenEvent`` batches (``index`` = seq);
``close`` cancels and counts.

Faults: a node lost (or at capacity) before the client saw a token → the
request is placed again (a new wire id, so late frames of the old attempt
cannot leak in; the old claim is cancelled); a node lost, failed or silent for
``token_timeout_s`` after it → the request migrates (``migration.py``: prompt +
streamed tokens on a new pair, up to ``max_migrations``, then one error event);
``P`` lost once ``D`` streams → ``D`` carries on. The iterator closed early
(client gone, stop string) → CANCEL to whichever side is still working.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from mlxcel_plugin.balancer_api import RequestInfo
from mlxcel_plugin.engine_api import FINISH_ERROR, GenerationRequest, TokenEvent
from mlxcel_plugin.errors import (
    AtCapacityError,
    CacheNotTransferableError,
    ContextLengthError,
    InvalidRequestError,
    MlxcelError,
    NodeLostError,
    NoHealthyNodeError,
)
from mlxcel_plugin.link.protocol.frames import Request
from mlxcel_plugin.logprobs import PromptLogprobs
from router_plugin.cluster.adapter_routing import adapter_placement, with_adapter
from router_plugin.cluster.migration import (
    TOKEN_TIMEOUT_CODE,
    MigrationLedger,
    failed_result_as_error,
    is_refused_handoff,
    moves_request,
    next_batch_within,
    stall_event,
)
from router_plugin.cluster.node_pool import NodeHealth
from router_plugin.cluster.peer_links import PeerEvent, PeerLink
from router_plugin.cluster.placement import Placement, wire_id
from router_plugin.cluster.routing_context import RoutingContext
from router_plugin.cluster.stream_bridge import (
    DECODE,
    PREFILL,
    BridgeOutput,
    BridgeState,
    ResultEvent,
    StreamBridge,
    token_events,
)

logger = logging.getLogger(__name__)

AT_CAPACITY_CODES = frozenset({AtCapacityError.code, NoHealthyNodeError.code})
# Another node may take it: this one is full, or no longer holds the request's LoRA adapter.
REPLACE_CODES = AT_CAPACITY_CODES | {"adapter_not_loaded"}
# A node's refusal that is the client's fault: the same 400 a single node would give
# (or 501: a model that cannot run disaggregated; no other node would do better).
CLIENT_ERRORS: dict[str, type[MlxcelError]] = {
    InvalidRequestError.code: InvalidRequestError,
    ContextLengthError.code: ContextLengthError,
    "prompt_too_long": ContextLengthError,
    CacheNotTransferableError.code: CacheNotTransferableError,
}

class RoutedRequest:
    """One admitted request: placement, the merged result streams, and its cleanup."""

    def __init__(self, context: RoutingContext, request: GenerationRequest):
        self.context = context
        self.request = request  # the current attempt's: a migration extends its prompt
        self.ledger = MigrationLedger(request, context.max_migrations)
        self.resumed_at_s: float | None = None  # set while a migrated attempt awaits a token
        self.blocks = context.pool.prefixes.blocks(request.prompt_tokens, request.adapter)
        self.adapter_digest: str | None = None  # of request.adapter, on both nodes placed
        self.bridge = StreamBridge()
        self.inbox: asyncio.Queue[tuple[int, PeerEvent]] = asyncio.Queue()
        self.placement: Placement | None = None
        self.excluded: set[str] = set()  # nodes that failed this request (never tried again)
        self.index = 0  # completion index of the next token
        self.cached_tokens = 0  # prompt tokens a node had cached (from its first Result)
        self.prompt_logprobs: PromptLogprobs | None = None  # the same, when asked
        self.refused = False  # answered 503: no node could take it
        context.stats.requests.total += 1
        context.stats.active_prefills += 1

    async def events(self) -> AsyncIterator[list[TokenEvent]]:
        try:
            await self._place()
            while not self.bridge.complete:  # ends with the bridge's one terminal output
                batch: list[TokenEvent] = []
                for attempt, event in await self._next_events():
                    if attempt != self.placement.attempt:
                        continue  # queued before a re-route or migration; its attempt is gone
                    for output in await self._on_event(event):
                        batch += self._token_events(output)
                if batch:
                    yield batch
        except AtCapacityError:
            self.refused = True  # raised before any token: the client gets 503 + Retry-After
            raise

    async def _next_events(self) -> list[tuple[int, PeerEvent]]:
        """The inbox's next batch; a stall between two tokens becomes a failure event.

        Only once the attempt has streamed: before its first token a (re-)prefill may
        queue like any request's, and a hung node is found by the health pings.
        """
        timeout_s = self.context.token_timeout_s if self.bridge.attempt_started else 0.0
        events = await next_batch_within(self.inbox, timeout_s or None)
        if events is not None:
            return events
        placement = self.placement
        return [(placement.attempt, stall_event(placement.decode.node_id, timeout_s))]

    # ------------------------------------------------------------ placement

    async def _place(self) -> None:
        info = RequestInfo(self.request.request_id, len(self.request.prompt_tokens),
                           self.request.max_tokens, self.request.cache_key)
        select, excluded, pool = self.context.select, self.excluded, self.context.pool
        now = self.context.clock()  # only pairs that can hand the KV over are ever placed
        self.adapter_digest, lacking = adapter_placement(pool, self.request.adapter, now)
        excluded = excluded | lacking
        decode = await select(DECODE, info, excluded | pool.unpaired_decodes(excluded, now),
                              self.blocks)
        # An adapter's K/V go whole: a decode node pins a held prefix by tokens alone.
        held = pool.cached_prefix_tokens(decode.node_id, self.blocks, now)
        held = held if self.request.adapter is None else 0
        prefill = None
        if not self._local_on(held):
            prefill = await select(PREFILL, info,
                                   excluded | pool.unpaired_prefills(decode.node_id, now),
                                   self.blocks)
        attempt = self.bridge.attempt
        placement = Placement(attempt, wire_id(self.request.request_id, attempt), prefill, decode,
                              prefill_done=prefill is None, decode_held_tokens=held)
        self.placement = placement
        for peer, _ in placement.sides():
            peer.register(placement.wire_id, self._sink(attempt))
            self.context.pool.on_dispatch(peer.node_id)
            self.context.pool.prefixes.record(peer.node_id, self.blocks)  # it will hold them
            self.context.pool.prefixes.record_key(self.request.cache_key, peer.node_id)
        self.context.on_load_change()
        if prefill is None:
            self.context.stats.requests.local_prefills += 1
            await self._send(placement, decode, self._request_frame(placement))
            return
        # REQUEST first: prefill is on the first token's path; D holds a KV that beats the claim.
        await self._send(placement, prefill, self._request_frame(placement))
        await self._send(placement, decode, self._claim_frame(placement))

    def _local_on(self, held: int) -> bool:
        """Does the decode node, holding ``held`` prompt tokens, lack few enough to prefill?"""
        limit = self.context.local_prefill_tokens
        missing = len(self.request.prompt_tokens) - held
        return limit > 0 and held > 0 and missing <= limit

    def _sink(self, attempt: int) -> Callable[[PeerEvent], None]:
        inbox = self.inbox
        return lambda event: inbox.put_nowait((attempt, event))

    async def _send(self, placement: Placement, peer: PeerLink, request: Request) -> None:
        request = with_adapter(request, self.request.adapter, self.adapter_digest)
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
        if placement.prefill is None:  # to the decode node itself: it prefills (local)
            return Request(placement.wire_id, list(r.prompt_tokens), r.sampling.to_dict(),
                           r.max_tokens, list(r.stop_token_ids))
        # To the prefill node: where to hand off, and what that node holds already, so only
        # the rest is shipped (a delta; a node that no longer holds it takes the whole cache).
        return Request(placement.wire_id, list(r.prompt_tokens), r.sampling.to_dict(),
                       r.max_tokens, list(r.stop_token_ids), placement.decode.address,
                       decode_cached_tokens=placement.decode_held_tokens)

    # ------------------------------------------------------------ events

    async def _on_event(self, event: PeerEvent) -> list[BridgeOutput]:
        placement = self.placement
        if self.bridge.complete:
            return []  # after the terminal (a failed migration), nothing more matters
        if event.source == DECODE:
            placement.prefill_done = True  # D has the KV (or P's part no longer matters)
            if placement.prefill is not None:  # the pair works: a refusal starts over
                self.context.pool.pairing.succeeded(placement.prefill.node_id,
                                                    placement.decode.node_id)
        event = failed_result_as_error(event)
        if event.lost or event.error is not None:
            if event.code != TOKEN_TIMEOUT_CODE:  # a silent node still works: cancel it
                self._side_done(event.source)
            return await self._on_failure(event)
        result = event.result
        if result.seq == 0 and not self.bridge.emitted_any_token:
            self.cached_tokens = result.cached_tokens  # reported with the first token
            self.prompt_logprobs = result.prompt_logprobs
        if result.finish_reason is not None:
            self._side_done(event.source)
        # else a non-final seq 0 leaves P busy handing the KV to D: it is cancelled if we stop.
        return self._feed(ResultEvent(event.source, result.seq, tuple(result.token_ids),
                                      result.finish_reason, result.error, self.bridge.attempt,
                                      result.logprobs))

    def _feed(self, result: ResultEvent) -> list[BridgeOutput]:
        had_token = self.bridge.emitted_any_token
        outputs = self.bridge.feed(result)
        if not had_token and self.bridge.emitted_any_token:
            self.context.stats.active_prefills -= 1
            self.context.stats.active_decodes += 1
        for output in outputs:
            self.ledger.record(output.token_ids)
        if self.resumed_at_s is not None and self.bridge.attempt_started:
            self.context.stats.observe_migration_resume(self.context.clock() - self.resumed_at_s)
            self.resumed_at_s = None
        return outputs

    async def _on_failure(self, event: PeerEvent) -> list[BridgeOutput]:
        if self.placement.prefill is not None and is_refused_handoff(event, self.bridge.state):
            return await self._reroute_refused(event)
        if self.bridge.emitted_any_token:
            return await self._on_failure_while_streaming(event)
        if self.bridge.can_reroute and self._worth_rerouting(event):
            await self._reroute(event.node_id)
            return []
        if event.code in CLIENT_ERRORS:
            raise CLIENT_ERRORS[event.code](f"{event.node_id} refused the request: {event.error}")
        if event.code in AT_CAPACITY_CODES:
            raise AtCapacityError(f"{event.node_id} at capacity: {event.error}")
        return self._end_with(event)

    async def _on_failure_while_streaming(self, event: PeerEvent) -> list[BridgeOutput]:
        if event.lost and event.source == PREFILL and self.bridge.state is BridgeState.DECODING:
            return []  # D streams this attempt: it owns the sequence now
        if self.ledger.can_migrate and moves_request(event, CLIENT_ERRORS):
            return await self._migrate(event)
        return self._end_with(event)

    def _end_with(self, event: PeerEvent) -> list[BridgeOutput]:
        """One error terminal for a failure nothing can cure."""
        if event.lost:
            return self.bridge.node_lost(event.source)
        return self.bridge.finish(FINISH_ERROR, event.error or f"{event.source} node failed")

    async def _migrate(self, event: PeerEvent) -> list[BridgeOutput]:
        logger.info("migrating %s after %d tokens: %s (%s)", self.request.request_id,
                    len(self.ledger.generated), event.node_id, event.error)
        self.context.stats.requests.migrated += 1
        return await self._continue_without(event, event.node_id)

    async def _reroute_refused(self, event: PeerEvent) -> list[BridgeOutput]:
        """The decode node refused the KV: that pair cools down; another pair takes over."""
        prefill, decode = self.placement.prefill.node_id, self.placement.decode.node_id
        code = event.code or "handoff_failed"
        cooldown_s = self.context.pool.pairing.cool(prefill, decode, self.context.clock())
        self.context.stats.count_refused_handoff(code)
        if not self.ledger.can_migrate:
            return self._end_with(event)
        logger.info("re-placing %s: %s refused the KV of %s (%s; the pair rests %.1f s)",
                    self.request.request_id, decode, prefill, code, cooldown_s)
        self.context.stats.requests.rerouted += 1
        return await self._continue_without(event, decode)

    async def _continue_without(self, event: PeerEvent, node_id: str) -> list[BridgeOutput]:
        """Continue on a pair without ``node_id``: prompt + streamed tokens, the budget left."""
        self.excluded.add(node_id)
        await self._release(self.placement, "migrated")
        self.request = self.ledger.next_request()
        self.blocks = self.context.pool.prefixes.blocks(self.request.prompt_tokens,
                                                        self.request.adapter)  # fmt: skip
        self.bridge.resume()
        self.resumed_at_s = self.context.clock()
        try:
            await self._place_again()
        except MlxcelError as exc:  # no healthy pair left (or none with room)
            logger.warning("%s cannot move: %s", self.request.request_id, exc.message)
            return self.bridge.finish(FINISH_ERROR, f"{event.error}; no node to move to")
        return []

    async def _place_again(self, *, rerouted: bool = False) -> None:
        """Place a moved request; if the nodes it excluded leave no pair, they may serve; if
        no pair is healthy, wait up to ``migration_wait_s`` for a node to come back (one the
        router dropped for silence, busy rather than dead, redials at once).

        A request re-routed before its first token keeps its exclusions: where a node it
        excluded is still healthy (it refused the request: at capacity), that refusal
        stands at once; where none is (the failed node is gone, and the others were dropped
        while the router itself read late), it waits for them like a migration."""
        deadline = self.context.clock() + self.context.migration_wait_s
        # Bounded: ``excluded`` empties at most once, then each pass waits out the deadline.
        while True:
            try:
                return await self._place()
            except NoHealthyNodeError:
                if rerouted and self._an_excluded_node_is_healthy():
                    raise
                if self.excluded and not rerouted:  # the failed node may not be at fault
                    self.excluded.clear()
                    continue
                left = deadline - self.context.clock()
                if left <= 0:
                    raise
                await self.context.wait_for_nodes(left)

    def _an_excluded_node_is_healthy(self) -> bool:
        pool = self.context.pool
        known = set(pool.ids())  # a node removed from membership meanwhile is not
        return any(node_id in known and pool.health(node_id) is NodeHealth.HEALTHY
                   for node_id in self.excluded)

    def _worth_rerouting(self, event: PeerEvent) -> bool:
        if self.bridge.attempt + 1 >= self.context.max_placements:
            return False
        return event.lost or event.code in REPLACE_CODES

    async def _reroute(self, failed_node_id: str) -> None:
        logger.info("re-routing %s: %s failed before its first token",
                    self.request.request_id, failed_node_id)
        self.excluded.add(failed_node_id)
        await self._release(self.placement, "rerouted")
        self.bridge.restart()
        self.context.stats.requests.rerouted += 1
        await self._place_again(rerouted=True)

    def _side_done(self, source: str) -> None:
        placement = self.placement
        if source == PREFILL:
            placement.prefill_done = True
        else:
            placement.decode_done = True

    def _token_events(self, output: BridgeOutput) -> list[TokenEvent]:
        events = token_events(self.request.request_id, self.index, output, self.cached_tokens,
                              self.prompt_logprobs)
        self.index += len(output.token_ids)
        return events

    # ------------------------------------------------------------ cleanup

    async def close(self) -> None:
        """Cancel what still runs, free the routes, count the outcome."""
        if self.placement is not None:
            await self._release(self.placement, "client closed the stream")
        if self.bridge.emitted_any_token:
            self.context.stats.active_decodes -= 1
        else:
            self.context.stats.active_prefills -= 1
        self._count_outcome()

    async def _release(self, placement: Placement, reason: str) -> None:
        if placement.released:
            return  # a re-placement that failed left it released already
        placement.released = True
        for peer, done in placement.sides():
            peer.unregister(placement.wire_id)
            self.context.pool.on_finish(peer.node_id)
            if not done:
                await peer.cancel(placement.wire_id, reason)

    def _count_outcome(self) -> None:
        counters = self.context.stats.requests
        if self.refused:
            counters.rejected += 1
        elif not self.bridge.complete:
            counters.closed_early += 1
        elif self.bridge.finish_reason == FINISH_ERROR:
            counters.failed += 1
        else:
            counters.completed += 1
