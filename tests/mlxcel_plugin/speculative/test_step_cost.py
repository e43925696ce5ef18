"""The per-row cost a node learns from the forwards it timed."""

from __future__ import annotations

import pytest

from mlxcel_plugin.speculative.step_cost import MAX_ROW_COST, MIN_SAMPLES, StepCost


def timed(cost: StepCost, rows: int, seconds: float, times: int = MIN_SAMPLES) -> None:
    for _ in range(times):
        cost.record(rows, seconds)


def test_the_prior_stands_until_two_row_counts_are_timed_enough():
    cost = StepCost(prior_row_cost=0.1)
    timed(cost, 1, 0.100)
    assert cost.row_cost == 0.1  # one row count: no slope yet
    timed(cost, 5, 0.200, times=MIN_SAMPLES - 1)
    assert cost.row_cost == 0.1  # the second not trusted yet
    cost.record(5, 0.200)
    # 0.100 s at 1 row, 0.200 s at 5: 25 ms a row, 75 ms fixed; one more row is 0.25 of one.
    assert cost.row_cost == pytest.approx(0.25)


def test_a_line_through_several_row_counts():
    cost = StepCost(prior_row_cost=0.1)
    for rows in (1, 2, 3, 5, 8):
        timed(cost, rows, 0.080 + 0.020 * rows)
    assert cost.row_cost == pytest.approx(0.2)


def test_recent_timings_weigh_more_so_a_change_of_load_is_followed():
    cost = StepCost(prior_row_cost=0.1)
    timed(cost, 1, 0.100)
    timed(cost, 3, 0.300)  # a verify of 3 rows during a load spike
    assert cost.row_cost == pytest.approx(1.0)
    timed(cost, 3, 0.120, times=30)
    assert cost.row_cost == pytest.approx(0.1, abs=0.01)


def test_noise_is_clamped_and_learning_can_be_turned_off():
    cost = StepCost(prior_row_cost=0.1)
    timed(cost, 1, 0.200)
    timed(cost, 4, 0.100)  # more rows, less time: noise, not a negative cost
    assert cost.row_cost == 0.0
    timed(cost, 4, 50.0, times=40)
    assert cost.row_cost == MAX_ROW_COST
    fixed = StepCost(prior_row_cost=0.3, learn=False)
    timed(fixed, 1, 0.1)
    timed(fixed, 4, 0.4)
    assert fixed.row_cost == 0.3


def test_a_follower_rank_uses_its_leader_s_cost_whatever_it_times():
    follower = StepCost(prior_row_cost=0.1)
    follower.follow(0.1)
    timed(follower, 1, 0.100)
    timed(follower, 5, 0.900)  # its own forwards would say 2.0 a row
    assert follower.row_cost == 0.1 and follower.samples == {}
    follower.follow(0.37)  # the leader's, sent with its step's tokens
    assert follower.row_cost == 0.37
