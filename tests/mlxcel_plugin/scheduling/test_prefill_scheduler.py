from __future__ import annotations

import pytest

from mlxcel_plugin.engine_api import EngineConfig
from mlxcel_plugin.errors import AtCapacityError, ConfigError, InvalidRequestError
from mlxcel_plugin.scheduling import (
    PrefillJob,
    PrefillScheduler,
    PrefillSchedulerConfig,
    RetryDecision,
    plan_chunks,
)
from mlxcel_plugin.scheduling.prefill_scheduler import (
    GIVE_UP_NO_TARGET,
    GIVE_UP_RETRIES_EXHAUSTED,
    GIVE_UP_TRANSFER_TIMEOUT,
    GIVE_UP_UNKNOWN_REQUEST,
    RETRY_OTHER_TARGET,
    RETRY_SAME_TARGET,
)


def scheduler(**overrides) -> PrefillScheduler:
    return PrefillScheduler(PrefillSchedulerConfig(**overrides))


def drain(s: PrefillScheduler, now: float) -> list[str]:
    order = []
    while (job := s.next_ready(now)) is not None:
        order.append(job.request_id)
        s.release(job.request_id)
    return order


def test_shorter_prompts_first_ties_in_submission_order():
    s = scheduler(max_concurrent_prefills=1)
    for rid, tokens in [("a", 300), ("b", 20), ("c", 300), ("d", 5)]:
        s.submit(PrefillJob(rid, tokens), now=0.0)
    assert drain(s, now=0.0) == ["d", "b", "a", "c"]


def test_aging_lets_a_long_prompt_overtake_newer_short_ones():
    # effective = tokens - 100/s * wait: "long" (1000 at t=0) vs shorts (10 at t=9.95, 10.0).
    s = scheduler(aging_rate_tokens_per_s=100.0)
    s.submit(PrefillJob("long", 1000), now=0.0)
    s.submit(PrefillJob("short-early", 10), now=9.85)  # key 995 < 1000
    s.submit(PrefillJob("short-late", 10), now=10.0)  # key 1010 > 1000
    assert drain(s, now=10.0) == ["short-early", "long", "short-late"]


def test_zero_aging_is_pure_shortest_first():
    s = scheduler(aging_rate_tokens_per_s=0.0)
    s.submit(PrefillJob("long", 1000), now=0.0)
    s.submit(PrefillJob("short", 10), now=1e6)
    assert drain(s, now=1e6) == ["short", "long"]


def test_max_concurrent_prefills_bounds_running_jobs():
    s = scheduler(max_concurrent_prefills=2)
    for rid in ("a", "b", "c"):
        s.submit(PrefillJob(rid, 10), now=0.0)
    assert [s.next_ready(0.0).request_id, s.next_ready(0.0).request_id] == ["a", "b"]
    assert s.next_ready(0.0) is None
    assert s.on_prefill_done("a", now=1.0, target="decode-0") == 1
    assert s.next_ready(1.0).request_id == "c"
    stats = s.stats()
    assert (stats.queued, stats.running, stats.handing_off) == (0, 2, 1)


def test_memory_above_threshold_is_refused_with_retry_after():
    s = scheduler(memory_threshold=0.9, retry_after_s=2.0)
    s.submit(PrefillJob("ok", 10), now=0.0, kv_used_fraction=0.9)  # at the threshold: fine
    with pytest.raises(AtCapacityError) as info:
        s.submit(PrefillJob("busy", 10), now=0.0, kv_used_fraction=0.91)
    assert (info.value.retry_after_s, info.value.status_code) == (2.0, 503)
    assert s.stats().queued == 1


def test_queue_bound_refuses_instead_of_growing():
    s = scheduler(max_queue_size=2)
    s.submit(PrefillJob("a", 10), now=0.0)
    s.submit(PrefillJob("b", 10), now=0.0)
    assert s.stats().queue_full is True
    with pytest.raises(AtCapacityError, match="queue full"):
        s.submit(PrefillJob("c", 10), now=0.0)


def test_duplicate_and_empty_requests_are_invalid():
    s = scheduler()
    s.submit(PrefillJob("a", 10), now=0.0)
    with pytest.raises(InvalidRequestError):
        s.submit(PrefillJob("a", 10), now=0.0)
    with pytest.raises(InvalidRequestError):
        s.submit(PrefillJob("b", 0), now=0.0)


def test_released_queued_job_is_skipped_and_its_id_can_be_reused():
    s = scheduler()
    s.submit(PrefillJob("a", 10), now=0.0)
    s.submit(PrefillJob("b", 20), now=0.0)
    assert s.release("a") is True
    s.submit(PrefillJob("a", 500), now=0.0)  # same id, new job, later in the order
    assert drain(s, now=0.0) == ["b", "a"]
    assert s.release("a") is False


def test_many_cancellations_do_not_grow_the_heap_without_bound():
    s = scheduler(max_concurrent_prefills=1, max_queue_size=10)
    for index in range(1000):
        s.submit(PrefillJob(f"r{index}", 10), now=0.0)
        s.release(f"r{index}")
    assert len(s._heap) <= 64 + 1


def test_chunk_plan():
    assert plan_chunks(1100, 512) == [(0, 512), (512, 1024), (1024, 1100)]
    assert plan_chunks(512, 512) == [(0, 512)]
    assert plan_chunks(7, None) == [(0, 7)]
    assert plan_chunks(0, 512) == []
    assert scheduler(chunk_size_tokens=4).plan_chunks(9) == [(0, 4), (4, 8), (8, 9)]
    assert scheduler(chunked_prefill_enabled=False).plan_chunks(9) == [(0, 9)]


def test_chunk_size_comes_from_the_engine_config():
    config = PrefillSchedulerConfig.from_engine_config(EngineConfig(chunk_size_tokens=256))
    assert config.chunk_size_tokens == 256
    overridden = PrefillSchedulerConfig.from_engine_config(EngineConfig(), max_queue_size=3)
    assert (overridden.chunk_size_tokens, overridden.max_queue_size) == (128, 3)


@pytest.mark.parametrize(
    "overrides",
    [
        {"memory_threshold": 0.0},
        {"memory_threshold": 1.5},
        {"max_concurrent_prefills": 0},
        {"max_handoff_retries": -1},
        {"transfer_timeout_s": 0.0},
    ],
)
def test_bad_config_is_a_startup_error(overrides):
    with pytest.raises(ConfigError):
        PrefillSchedulerConfig(**overrides)


# --- handoff ---------------------------------------------------------------------


def handing_off(**overrides) -> PrefillScheduler:
    s = scheduler(**overrides)
    s.submit(PrefillJob("r", 10, decode_target="decode-0"), now=0.0)
    s.next_ready(0.0)
    s.on_prefill_done("r", now=1.0, target="decode-0")
    return s


def test_ack_frees_the_handoff():
    s = handing_off()
    assert s.on_handoff_acked("r") is True
    assert s.on_handoff_acked("r") is False
    assert s.stats().handing_off == 0


def test_retries_prefer_an_untried_target_then_the_same_one_then_give_up():
    s = handing_off(max_handoff_retries=3)
    alternatives = ("decode-0", "decode-1")
    assert [
        s.on_handoff_failed("r", now=2.0, alternatives=alternatives),
        s.on_handoff_failed("r", now=3.0, alternatives=alternatives),
        s.on_handoff_failed("r", now=4.0, alternatives=alternatives),
        s.on_handoff_failed("r", now=5.0, alternatives=alternatives),
    ] == [
        RetryDecision(True, "decode-1", 2, RETRY_OTHER_TARGET),
        RetryDecision(True, "decode-1", 3, RETRY_SAME_TARGET),
        RetryDecision(True, "decode-1", 4, RETRY_SAME_TARGET),
        RetryDecision(False, "decode-1", 4, GIVE_UP_RETRIES_EXHAUSTED),
    ]
    assert s.stats().handing_off == 0


def test_a_lost_pinned_target_is_not_retried():
    s = handing_off()
    decision = s.on_handoff_failed("r", now=2.0, target_lost=True)
    assert decision == RetryDecision(False, "decode-0", 1, GIVE_UP_NO_TARGET)


def test_zero_retries_gives_up_at_once():
    s = handing_off(max_handoff_retries=0)
    assert s.on_handoff_failed("r", now=2.0).reason == GIVE_UP_RETRIES_EXHAUSTED


def test_retries_stop_at_the_transfer_deadline():
    s = handing_off(transfer_timeout_s=5.0)
    assert s.on_handoff_failed("r", now=5.9).retry is True
    assert s.on_handoff_failed("r", now=6.0) == RetryDecision(
        False, "decode-0", 2, GIVE_UP_TRANSFER_TIMEOUT
    )


def test_unknown_request_failure_is_answered_not_raised():
    assert scheduler().on_handoff_failed("nope", now=0.0) == RetryDecision(
        False, None, 0, GIVE_UP_UNKNOWN_REQUEST
    )


def test_expired_returns_handoffs_past_the_deadline_once():
    s = scheduler(transfer_timeout_s=5.0, max_concurrent_prefills=2)
    for rid, done_at in (("a", 1.0), ("b", 3.0)):
        s.submit(PrefillJob(rid, 10), now=0.0)
        s.next_ready(0.0)
        s.on_prefill_done(rid, now=done_at, target="decode-0")
    assert s.expired(now=5.9) == []
    assert s.expired(now=6.0) == ["a"]
    assert s.expired(now=6.0) == []
    assert s.handoff_attempt("a") is None
    assert s.handoff_attempt("b") == 1
    assert s.expired(now=100.0) == ["b"]


def test_a_handoff_whose_bytes_move_keeps_its_time():
    s = scheduler(transfer_timeout_s=5.0)
    s.submit(PrefillJob("slow", 10), now=0.0)
    s.next_ready(0.0)
    s.on_prefill_done("slow", now=1.0, target="decode-0")
    assert s.on_handoff_progress("slow", moved_s=None) == 6.0  # nothing moved yet
    assert s.on_handoff_progress("slow", moved_s=4.0) == 9.0  # frames still going out at 4 s
    assert s.expired(now=8.9) == []
    assert s.on_handoff_failed("slow", now=8.5).retry is True  # within 5 s of the last move
    # An older sighting, or a new attempt none of whose frames moved yet, moves nothing back.
    assert s.on_handoff_progress("slow", moved_s=2.0) == 9.0
    assert s.on_handoff_progress("slow", moved_s=None) == 9.0
    assert s.expired(now=9.0) == ["slow"]
    assert s.on_handoff_progress("slow", moved_s=20.0) is None  # forgotten: nothing to extend


def test_prefill_finishing_after_release_starts_no_handoff():
    s = scheduler()
    s.submit(PrefillJob("r", 10), now=0.0)
    s.next_ready(0.0)
    assert s.release("r") is True
    assert s.on_prefill_done("r", now=1.0, target="decode-0") is None
    assert s.stats().handing_off == 0
