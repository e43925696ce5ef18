"""Admission and backpressure: admit, queue or reject each request (HTTP 503 + Retry-After).

Pure: the router passes the pool's utilization and ``now``; the controller keeps
only the FIFO of queued request ids and their deadlines. The router answers
the client, logs and counts.

Load levels come from pool utilization (0..1, see ``pool_utilization``)::

    utilization <  moderate_utilization   -> Low       (always admit)
    utilization <  high_utilization       -> Moderate  (moderate_action)
    utilization <  critical_utilization   -> High      (high_action)
    otherwise                             -> Critical  (critical_action)

Actions are ``admit``, ``queue`` (wait in the router's FIFO until the level's
action is ``admit`` again, at most ``queue_timeout_s``) or ``reject``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from mlxcel_plugin.balancer_api import NodeView
from mlxcel_plugin.errors import AtCapacityError, ConfigError, ContextLengthError, MlxcelError

ADMIT = "admit"
QUEUE = "queue"
REJECT = "reject"
ACTIONS = (ADMIT, QUEUE, REJECT)

# Decision reasons (stable strings: the router counts them in metrics).
REASON_LOAD = "load"
REASON_QUEUE_FULL = "queue_full"
REASON_PROMPT_TOO_LONG = "prompt_too_long"
REASON_NO_HEALTHY_NODE = "no_healthy_node"
REASON_BEHIND_QUEUE = "behind_queue"


class LoadLevel(StrEnum):
    LOW = "low"
    MODERATE = "moderate"
    HIGH = "high"
    CRITICAL = "critical"


@dataclass(frozen=True)
class BackpressureConfig:
    """TOML section ``[backpressure]``; plain types so the config loader can coerce them."""

    moderate_utilization: float = 0.5
    high_utilization: float = 0.75
    critical_utilization: float = 0.9
    moderate_action: str = ADMIT
    high_action: str = QUEUE
    critical_action: str = REJECT
    queue_max_size: int = 256
    queue_timeout_s: float = 30.0
    retry_after_s: float = 1.0
    max_prompt_tokens: int = 1_048_576
    # Requests one node is counted as able to hold (queued + active); matches
    # the engine's max_sequences default.
    node_capacity_requests: int = 128

    def __post_init__(self) -> None:
        thresholds = (self.moderate_utilization, self.high_utilization, self.critical_utilization)
        if not 0.0 < thresholds[0] <= thresholds[1] <= thresholds[2] <= 1.0:
            raise ConfigError(
                "[backpressure] needs 0 < moderate_utilization <= high_utilization"
                f" <= critical_utilization <= 1, got {thresholds}"
            )
        for name in ("moderate_action", "high_action", "critical_action"):
            if getattr(self, name) not in ACTIONS:
                raise ConfigError(f"[backpressure] {name} must be one of {ACTIONS}")
        positive = ("queue_max_size", "max_prompt_tokens", "node_capacity_requests")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"[backpressure] {name} must be >= 1")
        if self.queue_timeout_s <= 0 or self.retry_after_s <= 0:
            raise ConfigError("[backpressure] queue_timeout_s and retry_after_s must be > 0")

    def level(self, utilization: float) -> LoadLevel:
        if utilization < self.moderate_utilization:
            return LoadLevel.LOW
        if utilization < self.high_utilization:
            return LoadLevel.MODERATE
        if utilization < self.critical_utilization:
            return LoadLevel.HIGH
        return LoadLevel.CRITICAL

    def action(self, level: LoadLevel) -> str:
        return {
            LoadLevel.LOW: ADMIT,
            LoadLevel.MODERATE: self.moderate_action,
            LoadLevel.HIGH: self.high_action,
            LoadLevel.CRITICAL: self.critical_action,
        }[level]


def node_utilization(node: NodeView, capacity_requests: int) -> float:
    """The busier of KV memory and request slots, clamped to 0..1."""
    by_memory = 1.0 - node.free_kv_fraction
    by_requests = node.load / capacity_requests
    return min(1.0, max(0.0, by_memory, by_requests))


def pool_utilization(nodes: Sequence[NodeView], capacity_requests: int) -> float | None:
    """Mean utilization of the healthy nodes; None when none is healthy.

    The router passes the busier of its prefill and decode pools.
    """
    healthy = [node for node in nodes if node.healthy]
    if not healthy:
        return None
    return sum(node_utilization(node, capacity_requests) for node in healthy) / len(healthy)


def retry_after_header(retry_after_s: float) -> str:
    """HTTP ``Retry-After`` takes whole seconds; never advertise 0."""
    return str(max(1, math.ceil(retry_after_s)))


@dataclass(frozen=True)
class AdmissionDecision:
    action: str  # ADMIT, QUEUE or REJECT
    level: LoadLevel
    reason: str
    retry_after_s: float | None = None

    def to_error(self) -> MlxcelError | None:
        """The error to answer a rejected request with (None unless rejected)."""
        if self.action != REJECT:
            return None
        if self.reason == REASON_PROMPT_TOO_LONG:
            return ContextLengthError("prompt is longer than the router accepts", param="messages")
        message = f"server at capacity ({self.reason}, load {self.level})"
        return AtCapacityError(message, retry_after_s=self.retry_after_s or 1.0)


class AdmissionController:
    """Decides admit/queue/reject and keeps the FIFO of queued request ids.

    Call ``pop_admittable`` in a loop (recomputing utilization after each
    dispatch) whenever load may have dropped: after a request finishes, after
    telemetry, after a ``decide`` that queued. Call ``expired`` on a timer and
    answer each returned id with ``timeout_error()``.
    """

    def __init__(self, config: BackpressureConfig | None = None):
        self.config = config or BackpressureConfig()
        self._queue: OrderedDict[str, float] = OrderedDict()  # request id -> deadline

    def __len__(self) -> int:
        return len(self._queue)

    def decide(
        self, request_id: str, prompt_tokens: int, utilization: float | None, now: float
    ) -> AdmissionDecision:
        if prompt_tokens > self.config.max_prompt_tokens:
            return AdmissionDecision(REJECT, LoadLevel.LOW, REASON_PROMPT_TOO_LONG)
        if utilization is None:
            # Not a load problem: selection raises NoHealthyNodeError after the re-probe.
            return AdmissionDecision(ADMIT, LoadLevel.LOW, REASON_NO_HEALTHY_NODE)
        level = self.config.level(utilization)
        action = self.config.action(level)
        reason = REASON_LOAD
        if action == ADMIT and self._queue:
            # First come, first served: nobody overtakes requests already waiting.
            action, reason = QUEUE, REASON_BEHIND_QUEUE
        if action == QUEUE:
            return self._enqueue(request_id, level, reason, now)
        retry_after_s = self.config.retry_after_s if action == REJECT else None
        return AdmissionDecision(action, level, reason, retry_after_s)

    def _enqueue(
        self, request_id: str, level: LoadLevel, reason: str, now: float
    ) -> AdmissionDecision:
        if len(self._queue) >= self.config.queue_max_size:
            return AdmissionDecision(REJECT, level, REASON_QUEUE_FULL, self.config.retry_after_s)
        self._queue[request_id] = now + self.config.queue_timeout_s
        return AdmissionDecision(QUEUE, level, reason)

    def pop_admittable(self, utilization: float | None, now: float) -> str | None:
        """The oldest unexpired queued id, if the current load level admits."""
        if utilization is not None and self.config.action(self.config.level(utilization)) != ADMIT:
            return None
        for request_id, deadline_s in self._queue.items():
            if deadline_s > now:
                del self._queue[request_id]
                return request_id
        return None

    def expired(self, now: float) -> list[str]:
        """Remove and return queued ids whose ``queue_timeout_s`` has passed."""
        gone = [rid for rid, deadline_s in self._queue.items() if deadline_s <= now]
        for request_id in gone:
            del self._queue[request_id]
        return gone

    def cancel(self, request_id: str) -> bool:
        """The client went away while queued."""
        return self._queue.pop(request_id, None) is not None

    def timeout_error(self) -> AtCapacityError:
        return AtCapacityError(
            "server at capacity (queue timeout)", retry_after_s=self.config.retry_after_s
        )


class RefusalCause(StrEnum):
    NO_HEALTHY_NODE = "no_healthy_node"  # every node Unreachable/Unknown: a probe may help
    QUEUE_FULL = "queue_full"  # nodes are up but busy: probing cannot help


class ReprobeGate:
    """Single-flight re-probe of unreachable nodes before refusing a request.

    At most one probe in flight and at most one start per ``min_interval_s``,
    router-wide, so a burst of refused requests cannot stampede dead peers. A
    probe whose ``end`` never came stops counting as in flight after
    ``probe_timeout_s`` (the connect timeout), so a lost callback cannot
    disable re-probing for good.
    """

    def __init__(self, min_interval_s: float = 0.25, probe_timeout_s: float = 0.5):
        self.min_interval_s = min_interval_s
        self.probe_timeout_s = probe_timeout_s
        self._last_start_s: float | None = None
        self._in_flight = False

    def try_begin(self, now: float, cause: RefusalCause = RefusalCause.NO_HEALTHY_NODE) -> bool:
        """True when the caller should probe now (and later call ``end``)."""
        if cause is not RefusalCause.NO_HEALTHY_NODE:
            return False
        if self._last_start_s is not None:
            since_s = now - self._last_start_s
            if self._in_flight and since_s < self.probe_timeout_s:
                return False
            if since_s < self.min_interval_s:
                return False
        self._last_start_s, self._in_flight = now, True
        return True

    def end(self) -> None:
        self._in_flight = False
