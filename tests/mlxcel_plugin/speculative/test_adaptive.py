"""The adaptive rule: exact choices for given acceptance histories (pure, no clock)."""

from __future__ import annotations

import pytest

from mlxcel_plugin.speculative.adaptive import (
    FIRST_BACKOFF_STEPS,
    AdaptiveController,
    best_k,
    expected_tokens,
)


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_best_k_grows_with_the_acceptance_rate_and_shrinks_with_cost():
    assert best_k(0.05, 4, 0.1) == 0
    assert best_k(0.5, 4, 0.1) == 2
    assert best_k(0.95, 4, 0.1) == 4
    assert best_k(0.95, 4, 2.0) == 0  # a verify row as dear as two steps never pays


def test_nearly_free_rows_still_need_a_real_gain():
    # Chat's 1-gram matches on SmolLM2 (7% accepted), rows at 0.025 of a step: one proposal
    # would yield 1.07 tokens for 1.025 steps, less than MIN_GAIN: a plain step instead.
    assert best_k(0.07, 4, 0.025) == 0
    assert best_k(0.2, 4, 0.025) == 2  # 1.24 tokens for 1.05: worth it


def test_a_sequence_that_keeps_missing_is_switched_off_then_probed_with_longer_backoffs():
    control = AdaptiveController(k_max=4, row_cost=0.1)
    limits = []
    while control.off_steps_left == 0:
        limits.append(control.proposal_limit())
        control.observe(limits[-1], 0)
    # The prior proposes 2; then one until the rate (21% here) no longer promises
    # MIN_GAIN more tokens per cost than a plain step.
    assert limits == [2, 1]
    assert control.off_steps_left == FIRST_BACKOFF_STEPS
    assert [control.proposal_limit() for _ in range(FIRST_BACKOFF_STEPS)] == [0] * 4
    assert control.proposal_limit() == 1  # the probe after the back-off
    control.observe(1, 0)
    assert control.off_steps_left == 2 * FIRST_BACKOFF_STEPS


def test_a_sequence_that_keeps_hitting_proposes_the_most():
    control = AdaptiveController(k_max=4, row_cost=0.1)
    for _ in range(5):
        control.observe(control.proposal_limit(), control.proposal_limit())
    assert control.proposal_limit() == 4
    assert control.rate > 0.9


def test_not_adaptive_always_proposes_the_most():
    control = AdaptiveController(k_max=3, row_cost=0.1, adaptive=False)
    for _ in range(5):
        control.observe(3, 0)
    assert control.proposal_limit() == 3
