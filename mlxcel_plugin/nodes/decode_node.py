"""The decode node: claims from routers, KV from prefill nodes, tokens back to the owner.

A router's claim (REQUEST with ``claim=True``) makes its link the owner of a
request. KV handoffs are assembled by ``HandoffReceiver`` on the event loop
and acked; a sequence goes to ``engine.decode`` only once its KV is complete,
claimed, and the ``DecodeScheduler`` admits it (memory, max_sequences). Each
token goes to the owner as RESULT ``seq = index`` (1, 2, ...). KV is freed on
completion, cancel, error, timeout, and when the owning router link closes.

A REQUEST without ``claim`` is a *local* request: the router found this node
holding most of the prompt in its prefix cache, so the node prefills the rest
itself (``engine.generate``) and sends every token from ``seq = 0``; no
prefill node is involved (docs/prefix-cache.md).

A *delta* handoff (``prefix_tokens`` in its begin) carries only the positions
after a prefix this node holds: the begin pins that prefix in the engine
(``reserve_prefix``) or is refused with ``prefix_missing`` before anything is
allocated, and the pin is released whenever the request ends without decoding
(docs/cluster-flow.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from mlxcel_plugin.engine_api import (
    FINISH_ERROR,
    GenerationRequest,
    TokenEvent,
    kv_buffer_maker,
    layer_adopter,
    release_prefix,
    reserve_prefix,
)
from mlxcel_plugin.engine_mailbox import EngineMailbox
from mlxcel_plugin.errors import AtCapacityError, HandoffError, MlxcelError
from mlxcel_plugin.kv_serde import HandoffHeader, PrefixMissing, make_ack
from mlxcel_plugin.kv_serde.convert import receiving_forms
from mlxcel_plugin.link import Link
from mlxcel_plugin.link.protocol.frames import (
    Cancel,
    ErrorFrame,
    Frame,
    FrameError,
    FrameType,
    Request,
    Result,
    Telemetry,
)
from mlxcel_plugin.nodes.decode_records import (
    Claim,
    DecodeNodeParts,
    Live,
    Ready,
    UnknownRequest,
)
from mlxcel_plugin.nodes.drain import NodeDrain
from mlxcel_plugin.nodes.handoff_receiver import Completed, HandoffReceiver, Refused
from mlxcel_plugin.nodes.kv_wire import KV_TYPES, message_to_frame
from mlxcel_plugin.nodes.metrics import DecodeMetrics, register_inference_extension
from mlxcel_plugin.nodes.node_adapters import NodeAdapters
from mlxcel_plugin.nodes.outbox import Outbox, token_result
from mlxcel_plugin.nodes.receive_pool_metrics import register_receive_pool
from mlxcel_plugin.nodes.requests import dispatch_router_frame, generation_request
from mlxcel_plugin.prefix_cache_metrics import prefix_telemetry, register_prefix_cache
from mlxcel_plugin.scheduling import DecodeScheduler
from mlxcel_plugin.speculative.metrics import register_speculative
from mlxcel_plugin.speculative.telemetry import spec_telemetry

logger = logging.getLogger(__name__)

HOUSEKEEPING_S = 0.25
UNCLAIMED = "<unclaimed>"
_ENDED_MEMORY = 4096


class DecodeNode:
    def __init__(self, parts: DecodeNodeParts, node_id: str):
        self.parts, self.engine, self.node_id = parts, parts.engine, node_id
        self.scheduler = DecodeScheduler(parts.scheduler_config)
        self.fingerprint, plain = receiving_forms(self.engine.info.fingerprint)  # convert.py
        self.receiver = HandoffReceiver(self.fingerprint, parts.codecs, self._admit_begin,
                                        adopt=layer_adopter(self.engine),
                                        make_buffers=kv_buffer_maker(self.engine),
                                        kv_budget_bytes=parts.kv_budget_bytes,
                                        model_bytes=parts.model_bytes, plain=plain)
        self.claims: dict[str, Claim] = {}
        self.local: dict[str, tuple[Claim, GenerationRequest]] = {}  # waiting for admission
        self.ready: dict[str, Ready] = {}
        self.live: dict[str, Live] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self.drain = NodeDrain(node_id)  # SIGTERM: refuse new claims, finish what is here
        self.adapters = NodeAdapters(self.engine)
        self._prefill_outboxes: dict[Link, Outbox] = {}
        self._tokens: EngineMailbox[TokenEvent] | None = None  # made on the loop
        stats = self.scheduler.stats
        self.metrics = DecodeMetrics(lambda: stats().queue_depth, lambda: len(self.live),
                                     lambda: stats().kv_used_bytes,
                                     lambda: self.engine.stats().kv_bytes)
        register_prefix_cache(self.metrics.registry, lambda: self.engine.stats().prefix_cache)
        register_speculative(self.metrics.registry, lambda: self.engine.stats().speculative)
        register_inference_extension(self.metrics.registry, self.telemetry)
        register_receive_pool(self.metrics.registry, self.receiver.pool_bytes)

    # -- state readers -----------------------------------------------------------------

    def telemetry(self) -> Telemetry:
        stats, engine = self.scheduler.stats(), self.engine.stats()
        return Telemetry(self.node_id, "decode", stats.queue_depth, len(self.live),
                         stats.free_kv_fraction, engine.tokens_per_s,
                         *prefix_telemetry(engine.prefix_cache), adapters=self.adapters.held(),
                         speculative=spec_telemetry(engine.speculative))

    def health(self) -> dict[str, Any]:
        stats = self.scheduler.stats()
        return {"status": "ok", "role": "decode", "node_id": self.node_id,
                "claims": len(self.claims), "ingesting": len(self.receiver.ingests),
                "ready": len(self.ready), "active": len(self.live),
                "backpressure": stats.backpressure, "kv_bytes": stats.kv_used_bytes,
                "ingest_bytes": self.receiver.allocated_bytes,
                "engine_kv_bytes": self.engine.stats().kv_bytes,
                "prefix_cache_bytes": self.engine.stats().prefix_cache.cached_bytes}

    # -- links -------------------------------------------------------------------------

    async def serve(self, link: Link) -> None:
        outbox = Outbox(link)
        is_router = link.peer_role == "router"
        if is_router:
            link.deliver_to(lambda frame: self._on_router_frame(outbox, frame))
        else:
            self._prefill_outboxes[link] = outbox
            link.set_body_sink(self.receiver.body_destination)  # KV bodies land in place
            # On the reader task: a KV_BEGIN is applied before the next chunk's body is
            # placed, so even a handoff's first chunk is decrypted straight into its layer.
            link.deliver_to(lambda frame: self._on_prefill_frame(link, outbox, frame))
        try:
            await link.wait_closed()
        finally:
            self._on_link_closed(link, outbox, is_router)

    def _on_link_closed(self, link: Link, outbox: Outbox, is_router: bool) -> None:
        if is_router:
            owned = [rid for rid, c in self.claims.items() if c.owner is outbox]
            owned += [rid for rid, live in self.live.items() if live.owner is outbox]
            owned += [rid for rid, (c, _) in self.local.items() if c.owner is outbox]
            for request_id in owned:
                self.cancel(request_id, "router link closed")
        else:
            self._prefill_outboxes.pop(link, None)
            lost = UnknownRequest("the prefill link closed mid-handoff", code="prefill_node_lost")
            for refused in self.receiver.drop_link(link, lost):
                release_prefix(self.engine, refused.request_id)
                self.scheduler.complete(refused.request_id, FINISH_ERROR)
        outbox.close()

    def _on_router_frame(self, outbox: Outbox, frame: Frame) -> None:
        dispatch_router_frame(
            frame,
            on_request=lambda request: self._on_claim(outbox, request),
            on_cancel=lambda request_id: self.cancel(request_id, "cancelled by the router"),
            reply=outbox.put, admit=self.drain.admit,
            on_adapter=lambda command: self.adapters.on_command(command, outbox.put),
        )

    def _on_prefill_frame(self, link: Link, outbox: Outbox, frame: Frame) -> None:
        try:
            if frame.type in KV_TYPES:
                self._on_outcome(self.receiver.feed(link, frame))
            elif frame.type is FrameType.CANCEL:
                request_id = Cancel.from_frame(frame).request_id
                if request_id not in self.live:
                    self.cancel(request_id, "handoff cancelled by the prefill node")
        except (FrameError, MlxcelError) as exc:
            request_id = frame.header.get("request_id")
            request_id = request_id if isinstance(request_id, str) else None
            outbox.put(ErrorFrame(exc.code or "error", exc.message, request_id).to_frame())

    # -- claims ------------------------------------------------------------------------

    def _on_claim(self, outbox: Outbox, frame: Request) -> None:
        request = generation_request(frame)  # validates the fields a router controls
        if frame.request_id in self.live or frame.request_id in self.local:
            raise MlxcelError(f"request {frame.request_id} is already decoding",
                              code="duplicate_request")
        self.adapters.check(frame.adapter, frame.adapter_digest)  # before any KV is taken
        if not frame.claim:
            self._on_local_request(outbox, request)
            return
        # A renewed claim (re-routed prefill) replaces the old one; the id lives again.
        self._ended.pop(frame.request_id, None)
        self.claims[frame.request_id] = Claim(outbox, adapter=frame.adapter)
        self._start_if_ready(frame.request_id)

    def _on_local_request(self, outbox: Outbox, request: GenerationRequest) -> None:
        """Prefill here (the prompt is mostly cached) and decode; admitted like a handoff."""
        kv_bytes = self.fingerprint.kv_bytes(len(request.prompt_tokens) + request.max_tokens)
        self._ended.pop(request.request_id, None)
        self.scheduler.offer(request.request_id, UNCLAIMED, kv_bytes)
        self.local[request.request_id] = (Claim(outbox), request)
        self.scheduler.on_kv_complete(request.request_id)
        self._admit()

    # -- ingestion ---------------------------------------------------------------------

    def _admit_begin(self, header: HandoffHeader) -> None:
        request_id = header.request_id
        if request_id in self._ended or request_id in self.live:
            raise UnknownRequest(f"request {request_id} is not awaiting KV (ended or cancelled)")
        self._pin_prefix(header)
        # As held here (a converting handoff widens or quantizes on arrival); a delta's too.
        kv_bytes = self.fingerprint.kv_bytes(header.prompt_length + header.sampling.max_tokens)
        self.ready.pop(request_id, None)
        try:
            self.scheduler.offer(request_id, UNCLAIMED, kv_bytes, header.epoch)
        except MlxcelError:
            release_prefix(self.engine, request_id)
            raise

    def _pin_prefix(self, header: HandoffHeader) -> None:
        """A delta's prefix must be held here: pinned for the request, or the begin is refused."""
        request_id, prefix = header.request_id, header.prefix_tokens
        release_prefix(self.engine, request_id)  # an earlier attempt's, if any
        tokens = header.sampling.prompt_tokens
        if prefix and not reserve_prefix(self.engine, request_id, tokens, prefix):
            raise PrefixMissing(f"this node holds no K/V for the first {prefix} prompt tokens")

    def _on_outcome(self, outcome: Completed | Refused | None) -> None:
        if isinstance(outcome, Refused):
            release_prefix(self.engine, outcome.request_id)
            self._send_refusal(outcome)
            if outcome.admitted:
                self.scheduler.complete(outcome.request_id, FINISH_ERROR)
        elif isinstance(outcome, Completed):
            ingest = outcome.ingest
            self.metrics.ingest_time.observe(time.monotonic() - ingest.started_s)
            if outcome.reader_busy_share is not None:
                self.metrics.reader_busy.observe(outcome.reader_busy_share)
            self.ready[ingest.request_id] = Ready(outcome)
            self._start_if_ready(ingest.request_id)

    def _send_refusal(self, refused: Refused) -> None:
        code = refused.error.code or "handoff_failed"
        if isinstance(refused.error, AtCapacityError):
            code = "at_capacity"
        self.metrics.refusals.labels(code).inc()
        logger.info("%s: refused handoff of %s: %s (%s)", self.node_id, refused.request_id,
                    code, refused.error.message)
        error = HandoffError(refused.error.message, code=code)
        ack = make_ack(refused.request_id, refused.handoff_id, refused.epoch, error)
        self._outbox_for(refused.reply).put(message_to_frame(ack))

    def _outbox_for(self, link: Link) -> Outbox:
        outbox = self._prefill_outboxes.get(link)
        if outbox is None:  # only a closed link has none; its frames would go nowhere
            outbox = Outbox(link)
        return outbox

    # -- decoding ----------------------------------------------------------------------

    def _start_if_ready(self, request_id: str) -> None:
        ready = self.ready.get(request_id)
        if ready is None or request_id not in self.claims:
            return
        ingest = ready.completed.ingest
        if not ready.acked:
            ready.acked = True
            self.metrics.handoffs.inc()
            ack = make_ack(ingest.request_id, ingest.handoff_id, ingest.epoch,
                           reader_busy_share=ready.completed.reader_busy_share)
            self._outbox_for(ingest.reply).put(message_to_frame(ack))
        self.scheduler.on_kv_complete(request_id, ready.completed.ingest.epoch)
        self._admit()

    def _admit(self) -> None:
        if self._tokens is None:
            self._tokens = EngineMailbox(asyncio.get_running_loop(), self._on_token)
        for request_id in self.scheduler.admit():
            if request_id in self.local:
                claim, request = self.local.pop(request_id)
                self.live[request_id] = Live(claim.owner)
                self.engine.generate(request, self._tokens.put)
                continue
            completed = self.ready.pop(request_id).completed
            claim = self.claims.pop(request_id)
            self.live[request_id] = Live(claim.owner)
            request = replace(completed.state.header.to_request(), adapter=claim.adapter)
            self.engine.decode(request, completed.first_token, completed.state.cache,
                               self._tokens.put)

    def _on_token(self, event: TokenEvent) -> None:
        live = self.live.get(event.request_id)
        if live is None:  # cancelled: the engine's last word is not wanted
            return
        now = time.monotonic()
        if event.token_id is not None:
            self.metrics.tpot.observe(now - live.last_token_s)
        live.last_token_s = now
        live.owner.put_result(token_result(event))
        if event.finish_reason is not None:
            self.metrics.finished.labels(event.finish_reason).inc()
            self._end(event.request_id)

    # -- ending ------------------------------------------------------------------------

    def cancel(self, request_id: str, reason: str) -> None:
        if self.live.pop(request_id, None) is not None:
            self.engine.cancel(request_id)
            self.metrics.finished.labels("cancelled").inc()
        gone = UnknownRequest(f"request {request_id} was cancelled: {reason}")
        for refused in self.receiver.drop(request_id, gone):
            self._send_refusal(refused)
        ready = self.ready.get(request_id)
        if ready is not None and not ready.acked:
            self._refuse_ready(ready, gone)
        self.claims.pop(request_id, None)
        self._end(request_id)

    def _end(self, request_id: str) -> None:
        release_prefix(self.engine, request_id)  # a delta that never decoded (else a no-op)
        self.live.pop(request_id, None)
        self.local.pop(request_id, None)
        self.ready.pop(request_id, None)
        self.claims.pop(request_id, None)
        self.scheduler.complete(request_id, "ended")
        self._ended[request_id] = None
        while len(self._ended) > _ENDED_MEMORY:
            self._ended.popitem(last=False)
        self._admit()

    def _fail_claim(self, request_id: str, error: HandoffError) -> None:
        claim = self.claims.get(request_id)
        if claim is not None:
            text = f"{error.code}: {error.message}"
            claim.owner.put_result(Result(request_id, 1, [], FINISH_ERROR, 1, text))
            self.metrics.finished.labels(FINISH_ERROR).inc()
        for refused in self.receiver.drop(request_id, error):
            self._send_refusal(refused)
        self.claims.pop(request_id, None)
        self._end(request_id)

    async def housekeeping(self) -> None:
        """Claims whose KV never came or stopped coming, and KV nobody claimed, end after
        transfer_timeout_s."""
        while True:  # cancelled at shutdown
            await asyncio.sleep(HOUSEKEEPING_S)
            self.expire(time.monotonic())

    def expire(self, now: float) -> None:
        cutoff = now - self.parts.transfer_timeout_s
        for ingest in self.receiver.stalled_since(cutoff):
            if ingest.request_id in self.claims:
                late = HandoffError("no KV of the handoff came for transfer_timeout_s",
                                    code="transfer_timeout")
                self._fail_claim(ingest.request_id, late)
            else:
                self._fail_claim(ingest.request_id, UnknownRequest("KV nobody claimed"))
        for request_id, claim in list(self.claims.items()):
            waiting = request_id in self.ready or self.receiver.by_request(request_id)
            if claim.created_s < cutoff and not waiting:
                late = HandoffError("the KV cache did not arrive in transfer_timeout_s",
                                    code="transfer_timeout")
                self._fail_claim(request_id, late)
        for request_id, ready in list(self.ready.items()):
            if request_id not in self.claims and ready.at_s < cutoff:
                self._refuse_ready(ready, UnknownRequest("KV nobody claimed"))
                self._end(request_id)

    def _refuse_ready(self, ready: Ready, error: HandoffError) -> None:
        ingest = ready.completed.ingest
        self._send_refusal(Refused(ingest.request_id, ingest.handoff_id, ingest.epoch,
                                   ingest.reply, error))

    async def close(self) -> None:
        for request_id in [*self.live, *self.claims, *self.local]:
            self.cancel(request_id, "node shutting down")
