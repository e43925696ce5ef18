from __future__ import annotations

import pytest

from mlxcel_plugin.engine_api import FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP, EngineConfig
from mlxcel_plugin.errors import AtCapacityError, ConfigError, HandoffError
from mlxcel_plugin.scheduling import DecodeScheduler, DecodeSchedulerConfig, SequenceState

MB = 1024 * 1024


def scheduler(**overrides) -> DecodeScheduler:
    base = {"kv_budget_bytes": 100 * MB, "memory_threshold": 0.8, "retry_after_s": 0.5}
    return DecodeScheduler(DecodeSchedulerConfig(**{**base, **overrides}))


def ready(s: DecodeScheduler, request_id: str, kv_mb: int = 1, owner: str = "router-a") -> None:
    s.offer(request_id, owner, kv_mb * MB)
    s.on_kv_complete(request_id)


def test_defaults_follow_the_design_and_the_engine_config():
    config = DecodeSchedulerConfig()
    assert (config.max_batch_size, config.max_sequences) == (32, 128)
    assert (config.memory_threshold, config.ingestion_queue_size) == (0.85, 64)
    engine = EngineConfig(max_batch_size=8, max_sequences=16, kv_memory_bytes=MB)
    derived = DecodeSchedulerConfig.from_engine_config(engine, ingestion_queue_size=4)
    assert (derived.max_batch_size, derived.max_sequences, derived.kv_budget_bytes) == (8, 16, MB)
    assert derived.ingestion_queue_size == 4


@pytest.mark.parametrize(
    "overrides", [{"memory_threshold": 0.0}, {"max_batch_size": 0}, {"ingestion_queue_size": 0}]
)
def test_bad_config_is_a_startup_error(overrides):
    with pytest.raises(ConfigError):
        DecodeSchedulerConfig(**overrides)


def test_sequence_lifecycle_ingesting_ready_active_gone():
    s = scheduler()
    s.offer("r1", "router-a", MB)
    assert s.state("r1") is SequenceState.INGESTING
    assert s.admit() == []  # KV not complete yet
    assert s.on_kv_complete("r1") is True
    assert s.state("r1") is SequenceState.READY
    assert s.admit() == ["r1"]
    assert s.state("r1") is SequenceState.ACTIVE
    assert s.complete("r1", FINISH_STOP) is True
    assert s.state("r1") is None
    assert s.complete("r1", FINISH_STOP) is False


def test_full_ingestion_queue_is_an_explicit_at_capacity_answer():
    s = scheduler(ingestion_queue_size=2)
    s.offer("r1", "router-a", MB)
    ready(s, "r2")
    assert s.backpressure is True
    with pytest.raises(AtCapacityError) as info:
        s.offer("r3", "router-a", MB)
    assert info.value.retry_after_s == 0.5
    assert s.stats().backpressure is True
    s.admit()  # r2 leaves the queue for the batch
    assert s.backpressure is False
    s.offer("r3", "router-a", MB)


def test_admission_is_fifo_and_stops_at_the_memory_threshold():
    s = scheduler()  # active may hold 80 MB
    for request_id, kv_mb in (("a", 50), ("b", 40), ("c", 10)):
        ready(s, request_id, kv_mb)
    assert s.admit() == ["a"]  # b does not fit; c must not overtake it
    s.complete("a", FINISH_LENGTH)
    assert s.admit() == ["b", "c"]


def test_admission_stops_at_max_sequences():
    s = scheduler(max_sequences=2)
    for request_id in ("a", "b", "c"):
        ready(s, request_id)
    assert s.admit() == ["a", "b"]
    assert s.admit() == []
    s.complete("b", FINISH_STOP)
    assert s.admit() == ["c"]


def test_a_kv_larger_than_the_active_limit_is_refused_for_good():
    with pytest.raises(HandoffError):
        scheduler().offer("huge", "router-a", 81 * MB)


def test_next_batch_rotates_over_active_sequences():
    s = scheduler(max_batch_size=2)
    for request_id in ("a", "b", "c"):
        ready(s, request_id)
    s.admit()
    assert [s.next_batch(), s.next_batch(), s.next_batch()] == [
        ["a", "b"],
        ["c", "a"],
        ["b", "c"],
    ]
    s.complete("b", FINISH_STOP)
    assert s.next_batch() == ["a", "c"]


def test_cancel_before_the_kv_arrives_refuses_the_kv_later():
    s = scheduler()
    assert s.cancel("r1") is False
    with pytest.raises(HandoffError, match="cancelled"):
        s.offer("r1", "router-a", MB)


def test_cancel_of_a_live_request_frees_it_and_refuses_a_retried_attempt():
    s = scheduler()
    s.offer("r1", "router-a", MB)
    assert s.cancel("r1") is True
    assert s.stats().kv_used_bytes == 0
    with pytest.raises(HandoffError):
        s.offer("r1", "router-a", MB, attempt=2)


def test_cancelled_memory_is_bounded():
    s = scheduler(cancelled_memory=2)
    for request_id in ("a", "b", "c"):
        s.cancel(request_id)
    s.offer("a", "router-a", MB)  # forgotten: accepted
    with pytest.raises(HandoffError):
        s.offer("c", "router-a", MB)


def test_a_newer_attempt_replaces_one_still_ingesting_but_not_a_stale_or_duplicate():
    s = scheduler()
    s.offer("r1", "router-a", MB, attempt=1)
    s.offer("r1", "router-a", 2 * MB, attempt=2)
    assert s.on_kv_complete("r1", attempt=1) is False  # the stale attempt's end
    with pytest.raises(HandoffError):
        s.offer("r1", "router-a", MB, attempt=2)
    assert s.on_kv_complete("r1", attempt=2) is True
    with pytest.raises(HandoffError):
        s.offer("r1", "router-a", MB, attempt=3)  # already ready: a duplicate
    assert s.stats().kv_used_bytes == 2 * MB


def test_drop_owner_frees_every_request_of_that_router_link():
    s = scheduler()
    s.offer("a1", "router-a", MB)
    ready(s, "b1", owner="router-b")
    ready(s, "a2", owner="router-a")
    s.admit()
    assert s.owner("a2") == "router-a"
    assert s.drop_owner("router-a") == ["a1", "a2"]
    assert s.drop_owner("router-a") == []
    assert s.next_batch() == ["b1"]
    with pytest.raises(HandoffError):
        s.offer("a1", "router-a", MB)  # its KV retried after the owner left


def test_stats_for_telemetry():
    s = scheduler(kv_budget_bytes=10 * MB, memory_threshold=1.0)
    s.offer("a", "router-a", 1 * MB)
    ready(s, "b", 2)
    ready(s, "c", 3)
    s.admit()
    s.complete("b", FINISH_CANCELLED)
    stats = s.stats()
    assert (stats.ingesting, stats.ready, stats.active, stats.queue_depth) == (1, 0, 1, 1)
    assert stats.kv_used_bytes == 4 * MB
    assert stats.free_kv_fraction == pytest.approx(0.6)
    assert stats.backpressure is False


def test_offers_reserve_the_kv_budget_until_their_sequence_ends():
    s = scheduler(kv_budget_bytes=128 * MB, memory_threshold=0.85)
    admitted, refused = [], []
    for i in range(64):  # 64 handoffs of 32 MiB into a 128 MiB budget
        try:
            s.offer(f"r{i}", "router-a", 32 * MB)
            admitted.append(i)
        except AtCapacityError as exc:
            refused.append(exc)
    assert admitted == [0, 1, 2, 3]
    assert len(refused) == 60 and {e.code for e in refused} == {"kv_budget_full"}
    assert refused[0].retry_after_s == 0.5
    s.complete("r0", FINISH_LENGTH)  # an ended sequence gives its reservation back
    s.offer("r4", "router-a", 32 * MB)
    with pytest.raises(AtCapacityError):
        s.offer("r5", "router-a", 32 * MB)


def test_a_retried_attempt_does_not_reserve_twice():
    s = scheduler(kv_budget_bytes=64 * MB, memory_threshold=1.0)
    s.offer("r", "router-a", 40 * MB, attempt=1)
    s.offer("r", "router-a", 40 * MB, attempt=2)  # replaces attempt 1's reservation
    assert s.stats().kv_used_bytes == 40 * MB
