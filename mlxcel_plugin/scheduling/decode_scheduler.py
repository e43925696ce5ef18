"""Decode scheduling: KV ingestion, admission into the batch, and who owns what.

Sans-I/O bookkeeping for the decode node. A sequence moves

    ingesting (KV arriving) -> ready (KV complete) -> active (in the batch) -> gone

Ingestion never blocks a decode step: arrivals wait in a bounded queue
(``ingestion_queue_size``; full -> an explicit at-capacity refusal that the
node relays to prefill nodes as backpressure, never an unbounded buffer).
``admit`` moves ready sequences into the batch, oldest first, while memory
and ``max_sequences`` allow. KV accounting is freed on completion (EOS,
max_tokens, stop, cancel, error), on cancel, and when the router link that
owns the request goes away (``drop_owner``).

Memory: each sequence reserves ``kv_bytes`` when offered; pass what it may
grow to (prompt + max_tokens), so an admitted sequence never runs out
mid-decode. Active sequences may hold up to ``memory_threshold`` of the
budget; the rest is headroom for KV still arriving.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, replace
from enum import StrEnum

from mlxcel_plugin.engine_api import EngineConfig
from mlxcel_plugin.errors import AtCapacityError, ConfigError, HandoffError
from mlxcel_plugin.memory_budget import with_kv_budget


class KVBudgetFull(AtCapacityError):
    """The KV a handoff needs does not fit what is reserved now; retry later."""

    code = "kv_budget_full"


class SequenceState(StrEnum):
    INGESTING = "ingesting"
    READY = "ready"
    ACTIVE = "active"


@dataclass(frozen=True)
class DecodeSchedulerConfig:
    """TOML section ``[decode_scheduler]``."""

    max_batch_size: int = 32  # sequences stepped together
    max_sequences: int = 128  # sequences resident (active) at once
    memory_threshold: float = 0.85  # share of the KV budget active sequences may hold
    ingestion_queue_size: int = 64
    kv_budget_bytes: int = 4 * 1024**3
    retry_after_s: float = 0.5
    # Ids cancelled before their KV arrived, remembered so a late KV is refused.
    cancelled_memory: int = 1024

    def __post_init__(self) -> None:
        if not 0.0 < self.memory_threshold <= 1.0:
            raise ConfigError("[decode_scheduler] memory_threshold must be in (0, 1]")
        for name in (
            "max_batch_size",
            "max_sequences",
            "ingestion_queue_size",
            "kv_budget_bytes",
            "cancelled_memory",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"[decode_scheduler] {name} must be >= 1")
        if self.retry_after_s <= 0:
            raise ConfigError("[decode_scheduler] retry_after_s must be > 0")

    @classmethod
    def from_engine_config(cls, engine: EngineConfig, **overrides: object) -> DecodeSchedulerConfig:
        """One source of defaults: the engine's batch, sequence and memory limits."""
        base = cls(
            max_batch_size=engine.max_batch_size,
            max_sequences=engine.max_sequences,
            memory_threshold=engine.memory_threshold,
            kv_budget_bytes=with_kv_budget(engine).kv_memory_bytes,  # 0: sized
        )
        return replace(base, **overrides)


@dataclass(frozen=True)
class DecodeSchedulerStats:
    """What the node reports in telemetry."""

    ingesting: int
    ready: int
    active: int
    kv_used_bytes: int
    free_kv_fraction: float
    backpressure: bool  # ingestion queue full: prefill nodes should hold off

    @property
    def queue_depth(self) -> int:
        return self.ingesting + self.ready


@dataclass
class _Sequence:
    request_id: str
    owner: str
    kv_bytes: int
    attempt: int
    state: SequenceState = SequenceState.INGESTING


class DecodeScheduler:
    def __init__(self, config: DecodeSchedulerConfig | None = None):
        self.config = config or DecodeSchedulerConfig()
        self._sequences: dict[str, _Sequence] = {}  # insertion order = arrival order
        self._rotation: deque[str] = deque()  # active ids, next to step first
        self._cancelled: OrderedDict[str, None] = OrderedDict()

    # --- ingestion ---------------------------------------------------------------

    def offer(self, request_id: str, owner: str, kv_bytes: int, attempt: int = 1) -> None:
        """A KV handoff begins. Raises to refuse it.

        ``AtCapacityError`` (retry later): the ingestion queue is full.
        ``HandoffError`` (final): cancelled, duplicate or stale attempt, or too
        large to ever fit. A newer ``attempt`` replaces one still ingesting.
        """
        if request_id in self._cancelled:
            raise HandoffError(f"request {request_id!r} was cancelled")
        if kv_bytes > self._active_limit_bytes():
            raise HandoffError(f"request {request_id!r} needs more KV memory than this node has")
        existing = self._sequences.get(request_id)
        if existing is not None:
            self._replace_attempt(existing, attempt)
        elif self.queue_depth >= self.config.ingestion_queue_size:
            raise AtCapacityError(
                "decode ingestion queue full", retry_after_s=self.config.retry_after_s
            )
        self._reserve(request_id, kv_bytes)
        self._sequences[request_id] = _Sequence(request_id, owner, kv_bytes, attempt)

    def _reserve(self, request_id: str, kv_bytes: int) -> None:
        """Every offered sequence holds its bytes until it ends: the budget bounds them all.

        Without this, KV still arriving was bounded only by the queue length
        (64 handoffs of 32 MiB were admitted into a 128 MiB budget).
        """
        reserved = sum(s.kv_bytes for s in self._sequences.values() if s.request_id != request_id)
        if reserved + kv_bytes > self.config.kv_budget_bytes:
            raise KVBudgetFull(
                f"decode KV budget full: {reserved} bytes reserved + {kv_bytes} asked > "
                f"{self.config.kv_budget_bytes}", retry_after_s=self.config.retry_after_s
            )

    def _replace_attempt(self, existing: _Sequence, attempt: int) -> None:
        if existing.state is not SequenceState.INGESTING or attempt <= existing.attempt:
            raise HandoffError(
                f"request {existing.request_id!r} attempt {attempt} is a duplicate or stale"
            )
        # The old attempt's partial KV is dropped; the new one takes its queue slot.
        del self._sequences[existing.request_id]

    def on_kv_complete(self, request_id: str, attempt: int = 1) -> bool:
        """All KV for this attempt arrived (checksum verified); False if stale or unknown."""
        sequence = self._sequences.get(request_id)
        if sequence is None or sequence.attempt != attempt:
            return False
        if sequence.state is not SequenceState.INGESTING:
            return False
        sequence.state = SequenceState.READY
        return True

    # --- batch -------------------------------------------------------------------

    def admit(self) -> list[str]:
        """Move ready sequences into the batch, oldest first, while memory allows.

        Strictly in arrival order: a large sequence at the head waits for room
        rather than being overtaken forever by small ones.
        """
        admitted: list[str] = []
        active_bytes = self._bytes_in(SequenceState.ACTIVE)
        for sequence in self._in_state(SequenceState.READY):
            if len(self._rotation) >= self.config.max_sequences:
                break
            if active_bytes + sequence.kv_bytes > self._active_limit_bytes():
                break
            sequence.state = SequenceState.ACTIVE
            active_bytes += sequence.kv_bytes
            self._rotation.append(sequence.request_id)
            admitted.append(sequence.request_id)
        return admitted

    def next_batch(self) -> list[str]:
        """Up to ``max_batch_size`` active ids for the next step, rotating for fairness."""
        count = min(self.config.max_batch_size, len(self._rotation))
        batch = [self._rotation[i] for i in range(count)]
        self._rotation.rotate(-count)
        return batch

    # --- ending ------------------------------------------------------------------

    def complete(self, request_id: str, finish_reason: str) -> bool:
        """EOS, max_tokens, stop, cancel or error: free the KV accounting.

        ``finish_reason`` (an ``engine_api.FINISH_*`` value) is for the caller's
        metrics; every reason frees the same way.
        """
        return self._forget(request_id)

    def cancel(self, request_id: str) -> bool:
        """True if the request was here (stop its engine work, free its KV).

        Either way the id is remembered, so a KV arriving later (not yet sent,
        or a retried attempt) is refused.
        """
        found = self._forget(request_id)
        self._remember_cancelled(request_id)
        return found

    def drop_owner(self, owner: str) -> list[str]:
        """The owning router link went away: forget and return its request ids."""
        owned = [s.request_id for s in self._sequences.values() if s.owner == owner]
        for request_id in owned:
            self._forget(request_id)
            self._remember_cancelled(request_id)
        return owned

    def _remember_cancelled(self, request_id: str) -> None:
        self._cancelled[request_id] = None
        self._cancelled.move_to_end(request_id)
        while len(self._cancelled) > self.config.cancelled_memory:
            self._cancelled.popitem(last=False)

    def _forget(self, request_id: str) -> bool:
        sequence = self._sequences.pop(request_id, None)
        if sequence is None:
            return False
        if sequence.state is SequenceState.ACTIVE:
            self._rotation.remove(request_id)
        return True

    # --- reading -----------------------------------------------------------------

    def state(self, request_id: str) -> SequenceState | None:
        sequence = self._sequences.get(request_id)
        return None if sequence is None else sequence.state

    def owner(self, request_id: str) -> str | None:
        sequence = self._sequences.get(request_id)
        return None if sequence is None else sequence.owner

    @property
    def queue_depth(self) -> int:
        return len(self._sequences) - len(self._rotation)

    @property
    def backpressure(self) -> bool:
        return self.queue_depth >= self.config.ingestion_queue_size

    def stats(self) -> DecodeSchedulerStats:
        used_bytes = sum(s.kv_bytes for s in self._sequences.values())
        free = max(0.0, 1.0 - used_bytes / self.config.kv_budget_bytes)
        return DecodeSchedulerStats(
            ingesting=len(self._in_state(SequenceState.INGESTING)),
            ready=len(self._in_state(SequenceState.READY)),
            active=len(self._rotation),
            kv_used_bytes=used_bytes,
            free_kv_fraction=free,
            backpressure=self.backpressure,
        )

    def _in_state(self, state: SequenceState) -> list[_Sequence]:
        return [s for s in self._sequences.values() if s.state is state]

    def _bytes_in(self, state: SequenceState) -> int:
        return sum(s.kv_bytes for s in self._in_state(state))

    def _active_limit_bytes(self) -> int:
        return int(self.config.memory_threshold * self.config.kv_budget_bytes)
