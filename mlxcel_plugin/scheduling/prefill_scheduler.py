"""Prefill scheduling: who prefills next, how many at once, and the KV handoff's retries.

Sans-I/O: the node calls in with ``now`` (seconds, any monotonic clock) and
what happened; the scheduler answers with what to do. It never sleeps, logs
or touches the engine.

Order: shortest prompt first, with aging so a long prompt cannot starve::

    effective_priority = prompt_tokens - aging_rate_tokens_per_s * wait_s   (lower runs first)

Since ``wait_s = now - submitted_at_s`` and ``now`` is the same for every
queued job, this orders exactly like the fixed key ``prompt_tokens +
aging_rate_tokens_per_s * submitted_at_s``; the heap uses that key, so no
re-sorting is needed as time passes. With the default 100 tokens/s, a
4096-token prompt waits at most ~40 s behind a stream of 1-token prompts.
Equal keys run in submission order.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field, replace

from mlxcel_plugin.engine_api import EngineConfig
from mlxcel_plugin.errors import AtCapacityError, ConfigError, InvalidRequestError

# RetryDecision reasons (stable strings: nodes count them in metrics).
RETRY_OTHER_TARGET = "other_target"
RETRY_SAME_TARGET = "same_target"
GIVE_UP_RETRIES_EXHAUSTED = "retries_exhausted"
GIVE_UP_TRANSFER_TIMEOUT = "transfer_timeout"
GIVE_UP_NO_TARGET = "no_target"
GIVE_UP_UNKNOWN_REQUEST = "unknown_request"


@dataclass(frozen=True)
class PrefillSchedulerConfig:
    """TOML section ``[prefill_scheduler]``."""

    max_concurrent_prefills: int = 1
    # Fraction of KV memory in use above which new requests are refused.
    memory_threshold: float = 0.9
    max_queue_size: int = 256
    chunked_prefill_enabled: bool = True
    chunk_size_tokens: int = 128
    aging_rate_tokens_per_s: float = 100.0
    max_handoff_retries: int = 2
    # How long a handoff (all attempts) may go with none of its KV moving before the prefill
    # copy is freed; bytes still flowing extend it.
    transfer_timeout_s: float = 30.0
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.memory_threshold <= 1.0:
            raise ConfigError("[prefill_scheduler] memory_threshold must be in (0, 1]")
        for name in ("max_concurrent_prefills", "max_queue_size", "chunk_size_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"[prefill_scheduler] {name} must be >= 1")
        if self.max_handoff_retries < 0 or self.aging_rate_tokens_per_s < 0:
            raise ConfigError(
                "[prefill_scheduler] max_handoff_retries and aging_rate_tokens_per_s must be >= 0"
            )
        if self.transfer_timeout_s <= 0 or self.retry_after_s <= 0:
            raise ConfigError(
                "[prefill_scheduler] transfer_timeout_s and retry_after_s must be > 0"
            )

    @classmethod
    def from_engine_config(
        cls, engine: EngineConfig, **overrides: object
    ) -> PrefillSchedulerConfig:
        """Take the chunk size from the engine so hybrid and prefill chunk alike (byte-exact)."""
        return replace(cls(chunk_size_tokens=engine.chunk_size_tokens), **overrides)


@dataclass(frozen=True)
class PrefillJob:
    request_id: str
    prompt_tokens: int
    # The router's choice; None: the node picks one of its own --decode-peers.
    decode_target: str | None = None


@dataclass(frozen=True)
class RetryDecision:
    retry: bool
    target: str | None
    attempt: int  # the handoff attempt epoch to put in the KV header (1 = first try)
    reason: str


@dataclass(frozen=True)
class PrefillSchedulerStats:
    queued: int
    running: int
    handing_off: int
    queue_full: bool


@dataclass
class _Handoff:
    job: PrefillJob
    target: str
    attempt: int
    deadline_s: float
    tried: list[str] = field(default_factory=list)


def plan_chunks(prompt_tokens: int, chunk_size_tokens: int | None) -> list[tuple[int, int]]:
    """``[start, end)`` token ranges; ``None`` chunk size means one chunk."""
    if prompt_tokens <= 0:
        return []
    size = prompt_tokens if chunk_size_tokens is None else chunk_size_tokens
    return [(start, min(start + size, prompt_tokens)) for start in range(0, prompt_tokens, size)]


class PrefillScheduler:
    def __init__(self, config: PrefillSchedulerConfig | None = None):
        self.config = config or PrefillSchedulerConfig()
        self._heap: list[tuple[float, int, str]] = []
        self._queued: dict[str, tuple[int, PrefillJob]] = {}  # id -> (heap order, job)
        self._running: dict[str, PrefillJob] = {}
        self._handoffs: dict[str, _Handoff] = {}
        self._order = itertools.count()

    # --- intake ----------------------------------------------------------------

    def submit(self, job: PrefillJob, now: float, *, kv_used_fraction: float = 0.0) -> None:
        """Queue a job, or raise ``AtCapacityError`` (with ``retry_after_s``) to refuse it."""
        if job.prompt_tokens < 1:
            raise InvalidRequestError("prompt must hold at least one token", param="prompt")
        if self._knows(job.request_id):
            raise InvalidRequestError(f"request {job.request_id!r} is already scheduled")
        if kv_used_fraction > self.config.memory_threshold:
            raise self._at_capacity(f"KV memory {kv_used_fraction:.0%} in use")
        if len(self._queued) >= self.config.max_queue_size:
            raise self._at_capacity("prefill queue full")
        key = job.prompt_tokens + self.config.aging_rate_tokens_per_s * now
        order = next(self._order)
        heapq.heappush(self._heap, (key, order, job.request_id))
        self._queued[job.request_id] = (order, job)

    def _at_capacity(self, why: str) -> AtCapacityError:
        return AtCapacityError(
            f"prefill node at capacity: {why}", retry_after_s=self.config.retry_after_s
        )

    def _knows(self, request_id: str) -> bool:
        return any(request_id in d for d in (self._queued, self._running, self._handoffs))

    # --- prefill ---------------------------------------------------------------

    def next_ready(self, now: float) -> PrefillJob | None:
        """The next job to prefill, if a slot is free; it counts as running from here."""
        if len(self._running) >= self.config.max_concurrent_prefills:
            return None
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self._is_live(entry):  # released jobs stay in the heap until popped
                _, job = self._queued.pop(entry[2])
                self._running[job.request_id] = job
                return job
        return None

    def _is_live(self, entry: tuple[float, int, str]) -> bool:
        # The order number tells a stale entry from a re-submission under the same id.
        queued = self._queued.get(entry[2])
        return queued is not None and queued[0] == entry[1]

    def plan_chunks(self, prompt_tokens: int) -> list[tuple[int, int]]:
        size = self.config.chunk_size_tokens if self.config.chunked_prefill_enabled else None
        return plan_chunks(prompt_tokens, size)

    def on_prefill_done(self, request_id: str, now: float, target: str) -> int | None:
        """Prefill finished; the handoff to ``target`` starts. Returns the attempt epoch (1).

        None: the request was released while prefilling; free its KV, send nothing.
        """
        job = self._running.pop(request_id, None)
        if job is None:
            return None
        deadline_s = now + self.config.transfer_timeout_s
        self._handoffs[request_id] = _Handoff(job, target, 1, deadline_s, [target])
        return 1

    # --- handoff ---------------------------------------------------------------

    def on_handoff_progress(self, request_id: str, moved_s: float | None) -> float | None:
        """The handoff's deadline (None: not handing off), after its bytes last moved at
        ``moved_s`` (None: none moved yet): no earlier than that plus the timeout."""
        handoff = self._handoffs.get(request_id)
        if handoff is None:
            return None
        if moved_s is not None:
            handoff.deadline_s = max(handoff.deadline_s, moved_s + self.config.transfer_timeout_s)
        return handoff.deadline_s

    def on_handoff_acked(self, request_id: str) -> bool:
        """The decode node holds the KV: the prefill copy can be freed."""
        return self._handoffs.pop(request_id, None) is not None

    def on_handoff_failed(
        self,
        request_id: str,
        now: float,
        *,
        alternatives: tuple[str, ...] = (),
        target_lost: bool = False,
    ) -> RetryDecision:
        """Decide whether and where to retry a failed handoff attempt.

        ``alternatives``: other decode targets in preference order (pass none
        when the router pinned the target). An untried alternative wins; else
        the same target again, unless ``target_lost`` (its link is gone). A
        decision with ``retry=False`` has already forgotten the request.
        """
        handoff = self._handoffs.get(request_id)
        if handoff is None:
            return RetryDecision(False, None, 0, GIVE_UP_UNKNOWN_REQUEST)
        if now >= handoff.deadline_s:
            return self._give_up(handoff, GIVE_UP_TRANSFER_TIMEOUT)
        if handoff.attempt > self.config.max_handoff_retries:
            return self._give_up(handoff, GIVE_UP_RETRIES_EXHAUSTED)
        untried = [target for target in alternatives if target not in handoff.tried]
        if untried:
            target, reason = untried[0], RETRY_OTHER_TARGET
        elif not target_lost:
            target, reason = handoff.target, RETRY_SAME_TARGET
        else:
            return self._give_up(handoff, GIVE_UP_NO_TARGET)
        handoff.target, handoff.attempt = target, handoff.attempt + 1
        handoff.tried.append(target)
        return RetryDecision(True, target, handoff.attempt, reason)

    def _give_up(self, handoff: _Handoff, reason: str) -> RetryDecision:
        del self._handoffs[handoff.job.request_id]
        return RetryDecision(False, handoff.target, handoff.attempt, reason)

    def expired(self, now: float) -> list[str]:
        """Forget and return handoffs past ``transfer_timeout_s``: free their KV, fail them."""
        gone = [rid for rid, h in self._handoffs.items() if now >= h.deadline_s]
        for request_id in gone:
            del self._handoffs[request_id]
        return gone

    def handoff_attempt(self, request_id: str) -> int | None:
        """The live attempt epoch; a KV ack for another epoch is stale."""
        handoff = self._handoffs.get(request_id)
        return None if handoff is None else handoff.attempt

    # --- anywhere --------------------------------------------------------------

    def release(self, request_id: str) -> bool:
        """Forget a request wherever it is (cancelled, failed, or finished at its first token)."""
        found = False
        for table in (self._queued, self._running, self._handoffs):
            found = table.pop(request_id, None) is not None or found
        if len(self._heap) > 2 * len(self._queued) + 64:
            self._compact_heap()
        return found

    def _compact_heap(self) -> None:
        # Cancellations while every slot is busy would otherwise grow the heap unboundedly.
        self._heap = [entry for entry in self._heap if self._is_live(entry)]
        heapq.heapify(self._heap)

    def stats(self) -> PrefillSchedulerStats:
        return PrefillSchedulerStats(
            queued=len(self._queued),
            running=len(self._running),
            handing_off=len(self._handoffs),
            queue_full=len(self._queued) >= self.config.max_queue_size,
        )
