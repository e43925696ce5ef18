"""Sans-I/O schedulers for the prefill and decode nodes (clock passed in, no I/O)."""

from mlxcel_plugin.scheduling.decode_scheduler import (
    DecodeScheduler,
    DecodeSchedulerConfig,
    DecodeSchedulerStats,
    SequenceState,
)
from mlxcel_plugin.scheduling.prefill_scheduler import (
    PrefillJob,
    PrefillScheduler,
    PrefillSchedulerConfig,
    PrefillSchedulerStats,
    RetryDecision,
    plan_chunks,
)

__all__ = [
    "DecodeScheduler",
    "DecodeSchedulerConfig",
    "DecodeSchedulerStats",
    "PrefillJob",
    "PrefillScheduler",
    "PrefillSchedulerConfig",
    "PrefillSchedulerStats",
    "RetryDecision",
    "SequenceState",
    "plan_chunks",
]
