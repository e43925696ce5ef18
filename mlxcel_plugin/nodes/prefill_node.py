"""The prefill node: REQUEST frames in, first token out, KV handed to a decode node.

Per request: validate (allowlist, sampling, size) → ``PrefillScheduler``
queue → ``engine.prefill`` with ``on_layer`` feeding the transfer strategy
(Streamed: layer i is on the wire while i+1 computes) → RESULT seq 0 to the
router at once → the strategy's end (carrying the first token) → wait for
KV_ACK, retrying per ``max_handoff_retries`` → free the KV copy on ack,
failure or ``transfer_timeout_s``. This node never generates past the first
token. A router's ``decode_cached_tokens`` makes the handoff a delta (the rest of the
prompt only); a decode node lacking that prefix gets it all at once (docs/cluster-flow.md).
The target must be able to take this node's KV, as its link verdict announced
(``decode_targets``); the K/V go in the narrower of the two dtypes (docs/compatibility.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mlxcel_plugin.compatibility import KVProfile
from mlxcel_plugin.engine_api import PrefillResult, prefill_rows
from mlxcel_plugin.engine_mailbox import EngineMailbox
from mlxcel_plugin.errors import MlxcelError
from mlxcel_plugin.kv_serde import AckHeader, ModelFingerprint
from mlxcel_plugin.libc import name_os_thread
from mlxcel_plugin.link import Link
from mlxcel_plugin.link.protocol.frames import (
    ErrorFrame,
    Frame,
    FrameError,
    Request,
    Result,
    Telemetry,
)
from mlxcel_plugin.nodes.decode_allowlist import DecodeAllowlist
from mlxcel_plugin.nodes.decode_targets import DecodeTargets
from mlxcel_plugin.nodes.drain import NodeDrain
from mlxcel_plugin.nodes.handoff_policy import FINAL_REFUSALS, delta_prefix_tokens, retries_in_full
from mlxcel_plugin.nodes.handoff_sender import DecodeLinks, OutgoingHandoff
from mlxcel_plugin.nodes.handoff_start import HandoffStarter
from mlxcel_plugin.nodes.metrics import PrefillMetrics, register_inference_extension
from mlxcel_plugin.nodes.node_adapters import NodeAdapters
from mlxcel_plugin.nodes.outbox import Outbox
from mlxcel_plugin.nodes.prefill_job import NodeJob, PrefillNodeParts
from mlxcel_plugin.nodes.requests import dispatch_router_frame, generation_request
from mlxcel_plugin.prefix_cache_metrics import prefix_telemetry, register_prefix_cache
from mlxcel_plugin.scheduling import PrefillJob, PrefillScheduler
from mlxcel_plugin.transfer import sends_rows_ahead

logger = logging.getLogger(__name__)

HOUSEKEEPING_S = 0.25


class PrefillNode:
    def __init__(self, parts: PrefillNodeParts, links: DecodeLinks, node_id: str,
                 env: Mapping[str, str] | None = None):
        self.parts, self.engine, self.node_id = parts, parts.engine, node_id
        self.scheduler = PrefillScheduler(parts.scheduler_config)
        self.links = links
        self.fingerprint = ModelFingerprint.from_dict(self.engine.info.fingerprint)
        own = parts.kv_profile or KVProfile.from_fingerprint(self.engine.info.fingerprint)
        allowlist = DecodeAllowlist.from_env(os.environ if env is None else env)
        self.targets = DecodeTargets(own, parts.decode_peers, allowlist, node_id)
        self.jobs: dict[str, NodeJob] = {}
        self.adapters = NodeAdapters(self.engine)
        self.drain = NodeDrain(node_id)  # SIGTERM: refuse new requests, finish these jobs
        self.metrics = PrefillMetrics(lambda: self.scheduler.stats().queued, self.held_kv_bytes)
        register_prefix_cache(self.metrics.registry, lambda: self.engine.stats().prefix_cache)
        register_inference_extension(self.metrics.registry, self.telemetry)
        self._tasks: set[asyncio.Task[None]] = set()
        self._engine_events: EngineMailbox[tuple[NodeJob, int | None, Any]] | None = None
        self._prompt_tokens = 0
        self._since_s = time.monotonic()
        # Encodes handoffs (the strategies' calls) off the event loop, one step at a time.
        self.encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-encode",
                                          initializer=name_os_thread)
        self.starter = HandoffStarter(parts, links, self.targets, self.fingerprint, self.encoder,
                                      self.metrics, node_id)

    # -- state readers -----------------------------------------------------------------

    def held_kv_bytes(self) -> int:
        return sum(job.result.cache.nbytes for job in self.jobs.values() if job.result)

    def kv_used_fraction(self) -> float:
        engine_used = 1.0 - self.engine.stats().free_kv_fraction
        return max(engine_used, self.held_kv_bytes() / max(1, self.parts.kv_budget_bytes))

    def telemetry(self) -> Telemetry:
        stats = self.scheduler.stats()
        elapsed = max(time.monotonic() - self._since_s, 1e-9)
        return Telemetry(self.node_id, "prefill", stats.queued, stats.running + stats.handing_off,
                         1.0 - self.kv_used_fraction(), self._prompt_tokens / elapsed,
                         *prefix_telemetry(self.engine.stats().prefix_cache),
                         adapters=self.adapters.held())

    def health(self) -> dict[str, Any]:
        stats = self.scheduler.stats()
        return {"status": "ok", "role": "prefill", "node_id": self.node_id,
                "queued": stats.queued, "running": stats.running,
                "handing_off": stats.handing_off, "jobs": len(self.jobs),
                "kv_bytes": self.held_kv_bytes(), "engine_kv_bytes": self.engine.stats().kv_bytes,
                "prefix_cache_bytes": self.engine.stats().prefix_cache.cached_bytes,
                "transfer": {"last_choice": self.starter.last_choice,
                             "last_reader_busy_share": self.starter.last_reader_busy_share,
                             "bandwidth_bytes_per_s": self.starter.bandwidth.snapshot()}}

    # -- router links ------------------------------------------------------------------

    async def serve(self, link: Link) -> None:
        """Handle one router link until it closes; then cancel what it owns."""
        outbox = Outbox(link)
        try:
            async for frame in link:  # until the link closes
                self._on_router_frame(outbox, frame)
        finally:
            for job in [j for j in self.jobs.values() if j.owner is outbox]:
                self.cancel(job.request_id, "router link closed")
            outbox.close()

    def _on_router_frame(self, outbox: Outbox, frame: Frame) -> None:
        dispatch_router_frame(frame, lambda request: self._on_request(outbox, request),
                              lambda request_id: self.cancel(request_id, "cancelled by the router"),
                              outbox.put, self.drain.admit,
                              lambda command: self.adapters.on_command(command, outbox.put))

    def _on_request(self, outbox: Outbox, frame: Request) -> None:
        if frame.claim:
            raise FrameError("a prefill node takes no claims", code="claim_refused")
        self.fingerprint.check_supported()  # a model with no handoff form: a 501 naming the class
        self.adapters.check(frame.adapter, frame.adapter_digest)  # its K/V depend on the adapter
        request = generation_request(frame)
        target, pinned = self.targets.choose(frame.decode_target)
        if self.targets.known(target):
            self._submit(outbox, frame, request, target, pinned)
        else:  # its profile first (one dial, the link stays): what it takes, in which dtype
            self._spawn(self._learn_then_submit(outbox, frame, request, target, pinned))

    async def _learn_then_submit(self, outbox: Outbox, frame: Request, request: Any,
                                 target: str, pinned: bool) -> None:
        await self.targets.learn(target, self.links)
        try:
            if not pinned:  # our own choice: the next peer that can take our KV
                target, pinned = self.targets.choose(None)
            self._submit(outbox, frame, request, target, pinned)
        except MlxcelError as exc:
            outbox.put(ErrorFrame(exc.code or "error", exc.message, request.request_id).to_frame())

    def _submit(self, outbox: Outbox, frame: Request, request: Any, target: str,
                pinned: bool) -> None:
        # A decode node pins a held prefix by tokens alone: an adapter's K/V always go whole.
        held = frame.decode_cached_tokens if frame.adapter is None else 0
        prefix = delta_prefix_tokens(held, pinned, self.fingerprint)
        now = time.monotonic()
        self.scheduler.submit(PrefillJob(request.request_id, len(request.prompt_tokens), target),
                              now, kv_used_fraction=self.kv_used_fraction())
        self.jobs[request.request_id] = NodeJob(request, outbox, target, pinned, now, prefix)
        self._pump()

    # -- prefill -----------------------------------------------------------------------

    def _pump(self) -> None:
        while (job := self.scheduler.next_ready(time.monotonic())) is not None:  # slots bound it
            self._start_prefill(self.jobs[job.request_id])

    def _start_prefill(self, job: NodeJob) -> None:
        if self._engine_events is None:
            self._engine_events = EngineMailbox(asyncio.get_running_loop(), self._on_engine_event)
        events = self._engine_events
        self.metrics.queue_time.observe(time.monotonic() - job.submitted_s)
        job.submitted_s = time.monotonic()
        # max_tokens == 1 ends at the first token; a target that cannot take our KV gets none.
        hands_off = job.request.max_tokens > 1 and self.targets.refusal(job.target) is None
        on_layer = (lambda index, layer: events.put((job, index, layer))) if hands_off else None
        def on_done(result: Any) -> None:
            events.put((job, None, result))

        def on_rows(index: int, first: int, arrays: Any) -> None:  # a cell's, as it ends
            events.put((job, (index, first), arrays))

        choice = self.starter.select(job, streaming=True) if hands_off else None
        strategy = self.parts.strategies.get(choice.strategy) if choice else None
        if sends_rows_ahead(strategy) and prefill_rows(self.engine):  # else no rows copied
            self.engine.prefill(job.request, on_done, on_layer, on_rows=on_rows)
        else:
            self.engine.prefill(job.request, on_done, on_layer)
        if choice is not None:
            # After the engine has the request (the first token's path), before any layer
            # event: those reach this loop only after this callback returns.
            job.handoff = self.starter.begin(job, 1, choice, streaming=True)

    def _on_engine_event(self, event: tuple[NodeJob, Any, Any]) -> None:
        """(index, layer), ((index, first token), a cell's rows) or (None, result): loop."""
        job, index, payload = event
        if index is None:
            self._on_prefill_done(job, payload)
        elif job.handoff is None:
            return
        elif isinstance(index, tuple):
            job.handoff.add_rows(*index, payload)
        else:
            job.handoff.add_layer(index, payload)

    def _on_prefill_done(self, job: NodeJob, result: PrefillResult | Exception) -> None:
        if self.jobs.get(job.request_id) is not job:  # cancelled meanwhile
            self._abort_handoff(job, "cancelled")
            return
        self.metrics.prefill_time.observe(time.monotonic() - job.submitted_s)
        if isinstance(result, Exception):
            self._abort_handoff(job, "prefill failed")
            code = getattr(result, "code", None) or "engine_error"
            self._finish(job, ErrorFrame(code, str(result), job.request_id), "engine_error")
            return
        self._prompt_tokens += len(job.request.prompt_tokens)
        first = Result(job.request_id, 0, [result.first_token], result.finish_reason, 1,
                       cached_tokens=result.cached_tokens,
                       logprobs=() if result.logprobs is None else (result.logprobs,),
                       prompt_logprobs=result.prompt_logprobs)
        if result.finish_reason is not None:
            self._abort_handoff(job, "first token ended the request")
            self._finish(job, first, "finished_at_first_token")
            return
        job.owner.put(first.to_frame())
        if job.handoff is None:  # refused before any KV went: the router places it again
            error = self.targets.refused_error(job.target)
            self._finish(job, ErrorFrame(error.code, error.message, job.request_id), error.code)
            return
        job.result, job.first_token_s = result, time.monotonic()
        self.scheduler.on_prefill_done(job.request_id, time.monotonic(), job.target)
        job.handoff.finish(result.first_token)
        job.waiter = self._spawn(self._await_handoff(job))
        self._pump()

    # -- handoff -----------------------------------------------------------------------

    async def _await_handoff(self, job: NodeJob) -> None:
        while job.handoff is not None:  # one pass per attempt; the scheduler bounds retries
            handoff, error, code = job.handoff, "", ""
            try:
                ack = await self._ack_while_moving(job, handoff)
                if ack.ok:
                    self._on_acked(job, handoff, ack)
                    return
                error, code = ack.error or "refused", ack.error_code or "handoff_failed"
            except TimeoutError:
                error, code = "no ack before transfer_timeout_s", "transfer_timeout"
            except MlxcelError as exc:
                error, code = exc.message, exc.code or "handoff_failed"
            if not await self._retry(job, handoff, code, error):
                return

    async def _ack_while_moving(self, job: NodeJob, handoff: OutgoingHandoff) -> AckHeader:
        """The attempt's ack; TimeoutError at the scheduler's deadline for the handoff, which
        frames still moving push on (a slow link's long handoff keeps its time while its bytes
        flow; every attempt shares one budget otherwise)."""
        while True:  # bounded: each pass waits until the deadline the latest progress gives
            deadline_s = self.scheduler.on_handoff_progress(job.request_id, handoff.progressed_s)
            if deadline_s is None:  # the scheduler let it go (released): the first budget
                deadline_s = job.first_token_s + self.parts.transfer_config.transfer_timeout_s
            remaining = deadline_s - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            try:
                return await asyncio.wait_for(asyncio.shield(handoff.ack), remaining)
            except TimeoutError:
                continue  # frames may have moved meanwhile: the loop looks again

    def _on_acked(self, job: NodeJob, handoff: OutgoingHandoff, ack: AckHeader) -> None:
        self.metrics.observe_handoff(time.monotonic() - job.first_token_s, handoff.sent_bytes,
                                     handoff.chunks_ahead, handoff.rows_stopped)
        self.starter.last_reader_busy_share = ack.reader_busy_share
        sample = handoff.link_sample(time.monotonic())
        paced_by = sample.paced_by(ack.reader_busy_share)
        self.metrics.handoff_paced.labels(paced_by).inc()
        self.starter.bandwidth.observe(job.target, sample.nbytes, sample.seconds,
                                       paced_by=paced_by)
        if job.choice is not None:
            self.starter.selector.observe_ratio(job.choice.codec, job.choice.payload_bytes,
                                        handoff.sent_bytes)
        self.scheduler.on_handoff_acked(job.request_id)
        self._forget(job, "handed_off")

    async def _retry(self, job: NodeJob, failed: OutgoingHandoff, code: str, error: str) -> bool:
        """Start the next attempt, or report the failure; True when retrying."""
        logger.info("%s: handoff of %s to %s failed: %s (%s)", self.node_id, job.request_id,
                    job.target, code, error)
        self._abort_handoff(job, code)
        if retries_in_full(code, failed.header):  # the prefix is not there: send it all, now
            self.metrics.handoff_prefix_missing.inc()
            job.prefix_tokens = 0
            self._resend(job, failed.header.epoch + 1)
            return True
        alternatives = () if job.pinned else tuple(p for p in self.parts.decode_peers)
        decision = self.scheduler.on_handoff_failed(
            job.request_id, time.monotonic(), alternatives=alternatives,
            target_lost=code == "decode_node_lost")
        if code in FINAL_REFUSALS or not decision.retry:
            self.scheduler.release(job.request_id)
            reason = code if code in FINAL_REFUSALS else decision.reason
            self.metrics.handoff_failures.labels(reason).inc()
            # By the refusal's code: the router places the request on another pair.
            text = f"KV handoff to {job.target} failed: {code}: {error}"
            self._finish(job, ErrorFrame(code, text, job.request_id), "handoff_failed")
            return False
        self.metrics.handoff_retries.inc()
        if code == "at_capacity":
            await asyncio.sleep(self.parts.scheduler_config.retry_after_s)
        if self.jobs.get(job.request_id) is not job:
            return False
        if (decision.target or job.target) != job.target:
            job.target, job.prefix_tokens = decision.target, 0  # another node, another cache
        self._resend(job, max(decision.attempt, failed.header.epoch + 1))
        return True

    def _resend(self, job: NodeJob, epoch: int) -> None:
        """Another attempt from the cache prefill left, every layer at once."""
        job.handoff = self.starter.begin(job, epoch, self.starter.select(job, streaming=False),
                                          streaming=False, first_token=job.result.first_token)
        for index, layer in enumerate(job.result.cache.layers):
            job.handoff.add_layer(index, layer)
        job.handoff.finish(job.result.first_token)

    def _abort_handoff(self, job: NodeJob, reason: str) -> None:
        handoff = job.handoff
        if handoff is None:
            return
        if not handoff.ack.done():
            handoff.fail(MlxcelError(reason, code="cancelled"))
            self._spawn(self.links.cancel_on_target(handoff, reason))
        handoff.aborted = True

    # -- ending ------------------------------------------------------------------------

    def cancel(self, request_id: str, reason: str) -> None:
        job = self.jobs.get(request_id)
        if job is None:
            return
        self.engine.cancel(request_id)  # a queued prefill is dropped; a running one finishes
        self._abort_handoff(job, reason)
        if job.waiter is not None:
            job.waiter.cancel()
        self._forget(job, "cancelled")

    def _finish(self, job: NodeJob, frame: Result | ErrorFrame, outcome: str) -> None:
        job.owner.put(frame.to_frame())
        self._forget(job, outcome)

    def _forget(self, job: NodeJob, outcome: str) -> None:
        """Free the KV copy and every trace of the request."""
        if self.jobs.get(job.request_id) is job:
            del self.jobs[job.request_id]
            self.metrics.requests.labels(outcome).inc()
        self.scheduler.release(job.request_id)
        job.result, job.handoff = None, None
        self._pump()

    async def housekeeping(self) -> None:
        """Backstop for handoffs past ``transfer_timeout_s`` (the waiter normally ends them)."""
        while True:  # cancelled at shutdown
            await asyncio.sleep(HOUSEKEEPING_S)
            for request_id in self.scheduler.expired(time.monotonic()):
                job = self.jobs.get(request_id)
                if job is not None and job.waiter is None:
                    self._forget(job, "transfer_timeout")

    # -- plumbing ----------------------------------------------------------------------

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        for request_id in list(self.jobs):
            self.cancel(request_id, "node shutting down")
        for task in list(self._tasks):
            task.cancel()
        self.encoder.shutdown(wait=False, cancel_futures=True)
        await self.links.close()
