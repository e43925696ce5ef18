from __future__ import annotations

import pytest

from mlxcel_plugin.balancer_api import NodeView
from mlxcel_plugin.errors import AtCapacityError, ConfigError, ContextLengthError
from router_plugin.cluster.admission import (
    ADMIT,
    QUEUE,
    REASON_BEHIND_QUEUE,
    REASON_NO_HEALTHY_NODE,
    REASON_PROMPT_TOO_LONG,
    REASON_QUEUE_FULL,
    REJECT,
    AdmissionController,
    BackpressureConfig,
    LoadLevel,
    RefusalCause,
    ReprobeGate,
    node_utilization,
    pool_utilization,
    retry_after_header,
)

CONFIG = BackpressureConfig(
    moderate_utilization=0.5,
    high_utilization=0.75,
    critical_utilization=0.9,
    queue_max_size=2,
    queue_timeout_s=10.0,
    retry_after_s=2.5,
    max_prompt_tokens=1000,
    node_capacity_requests=10,
)


@pytest.mark.parametrize(
    ("utilization", "level"),
    [
        (0.0, LoadLevel.LOW),
        (0.49, LoadLevel.LOW),
        (0.5, LoadLevel.MODERATE),
        (0.75, LoadLevel.HIGH),
        (0.9, LoadLevel.CRITICAL),
        (1.0, LoadLevel.CRITICAL),
    ],
)
def test_load_levels_from_utilization(utilization, level):
    assert CONFIG.level(utilization) is level


def test_defaults_follow_the_design():
    config = BackpressureConfig()
    assert config.max_prompt_tokens == 1_048_576
    assert [config.action(level) for level in LoadLevel] == [ADMIT, ADMIT, QUEUE, REJECT]


@pytest.mark.parametrize(
    "overrides",
    [
        {"moderate_utilization": 0.8, "high_utilization": 0.7},
        {"critical_utilization": 1.5},
        {"moderate_utilization": 0.0},
        {"high_action": "drop"},
        {"queue_max_size": 0},
        {"queue_timeout_s": 0.0},
    ],
)
def test_bad_config_is_a_startup_error(overrides):
    with pytest.raises(ConfigError):
        BackpressureConfig(**overrides)


def test_utilization_is_the_busier_of_memory_and_request_slots():
    busy_memory = NodeView("decode-0", "a:1", free_kv_fraction=0.2, queue_depth=1)
    busy_slots = NodeView("decode-1", "b:1", queue_depth=4, active_sequences=3, in_flight=1)
    assert node_utilization(busy_memory, 10) == pytest.approx(0.8)
    assert node_utilization(busy_slots, 10) == pytest.approx(0.8)
    assert node_utilization(NodeView("d", "c:1", queue_depth=50), 10) == 1.0
    down = NodeView("decode-2", "c:1", healthy=False, free_kv_fraction=0.0)
    assert pool_utilization([busy_memory, down, NodeView("x", "d:1")], 10) == pytest.approx(0.4)
    assert pool_utilization([down], 10) is None


def test_low_load_admits_and_high_load_queues_fifo_then_releases():
    controller = AdmissionController(CONFIG)
    assert controller.decide("r1", 10, utilization=0.1, now=0.0).action == ADMIT
    queued = controller.decide("r2", 10, utilization=0.8, now=1.0)
    assert (queued.action, queued.level, queued.to_error()) == (QUEUE, LoadLevel.HIGH, None)
    # Load fell, but r3 must not overtake r2.
    behind = controller.decide("r3", 10, utilization=0.2, now=2.0)
    assert (behind.action, behind.reason) == (QUEUE, REASON_BEHIND_QUEUE)
    assert controller.pop_admittable(utilization=0.8, now=3.0) is None
    assert controller.pop_admittable(utilization=0.6, now=3.0) == "r2"
    assert controller.pop_admittable(utilization=0.6, now=3.0) == "r3"
    assert controller.pop_admittable(utilization=0.6, now=3.0) is None
    assert len(controller) == 0


def test_critical_load_rejects_with_retry_after_as_503():
    decision = AdmissionController(CONFIG).decide("r1", 10, utilization=0.95, now=0.0)
    assert (decision.action, decision.level, decision.retry_after_s) == (
        REJECT,
        LoadLevel.CRITICAL,
        2.5,
    )
    error = decision.to_error()
    assert isinstance(error, AtCapacityError)
    assert (error.status_code, error.retry_after_s) == (503, 2.5)
    assert retry_after_header(decision.retry_after_s) == "3"
    assert retry_after_header(0.1) == "1"


def test_full_queue_rejects_instead_of_growing():
    controller = AdmissionController(CONFIG)
    assert controller.decide("r1", 10, 0.8, now=0.0).action == QUEUE
    assert controller.decide("r2", 10, 0.8, now=0.0).action == QUEUE
    full = controller.decide("r3", 10, 0.8, now=0.0)
    assert (full.action, full.reason, full.retry_after_s) == (REJECT, REASON_QUEUE_FULL, 2.5)
    assert len(controller) == 2


def test_queue_timeout_expires_in_order_and_expired_are_never_admitted():
    controller = AdmissionController(CONFIG)
    controller.decide("r1", 10, 0.8, now=0.0)
    controller.decide("r2", 10, 0.8, now=5.0)
    assert controller.pop_admittable(utilization=0.1, now=10.0) == "r2"
    assert controller.expired(now=10.0) == ["r1"]
    assert controller.expired(now=20.0) == []
    assert controller.timeout_error().retry_after_s == 2.5


def test_cancel_removes_a_queued_request():
    controller = AdmissionController(CONFIG)
    controller.decide("r1", 10, 0.8, now=0.0)
    assert controller.cancel("r1") is True
    assert controller.cancel("r1") is False
    assert controller.pop_admittable(utilization=0.1, now=1.0) is None


def test_prompt_over_the_limit_is_a_400_not_a_retry():
    decision = AdmissionController(CONFIG).decide("r1", 1001, utilization=0.0, now=0.0)
    assert (decision.action, decision.reason) == (REJECT, REASON_PROMPT_TOO_LONG)
    assert isinstance(decision.to_error(), ContextLengthError)
    assert decision.to_error().status_code == 400


def test_no_healthy_node_is_left_to_selection_and_the_reprobe():
    decision = AdmissionController(CONFIG).decide("r1", 10, utilization=None, now=0.0)
    assert (decision.action, decision.reason) == (ADMIT, REASON_NO_HEALTHY_NODE)


def test_configured_actions_per_level():
    config = BackpressureConfig(moderate_action=QUEUE, high_action=REJECT)
    controller = AdmissionController(config)
    assert controller.decide("a", 1, 0.6, now=0.0).action == QUEUE
    assert controller.decide("b", 1, 0.8, now=0.0).action == REJECT


# --- re-probe gate --------------------------------------------------------------


def test_reprobe_gate_allows_one_probe_per_250ms_router_wide():
    gate = ReprobeGate()
    starts = []
    for now in (0.0, 0.1, 0.2, 0.26, 0.3, 0.5, 0.52):
        if gate.try_begin(now):
            starts.append(now)
            gate.end()
    assert starts == [0.0, 0.26, 0.52]


def test_reprobe_gate_is_single_flight_until_end_or_connect_timeout():
    gate = ReprobeGate(min_interval_s=0.25, probe_timeout_s=0.5)
    assert gate.try_begin(0.0) is True
    assert gate.try_begin(0.3) is False  # still in flight
    assert gate.try_begin(0.49) is False
    assert gate.try_begin(0.5) is True  # the lost probe timed out
    gate.end()
    assert gate.try_begin(0.6) is False  # interval
    assert gate.try_begin(0.75) is True


def test_a_full_queue_never_triggers_a_probe():
    gate = ReprobeGate()
    assert gate.try_begin(0.0, RefusalCause.QUEUE_FULL) is False
    assert gate.try_begin(10.0, RefusalCause.QUEUE_FULL) is False
    # ... and does not use up the slot of a real no-healthy-node refusal.
    assert gate.try_begin(10.0, RefusalCause.NO_HEALTHY_NODE) is True
