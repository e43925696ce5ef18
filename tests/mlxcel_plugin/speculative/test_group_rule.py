"""The group rule: a batch group verifies no deeper than its rows pay for."""

from __future__ import annotations

from mlxcel_plugin.speculative.adaptive import best_k
from mlxcel_plugin.speculative.group_rule import capped, forward_cost, group_width


def test_one_sequence_is_the_per_sequence_rule():
    for rate in (0.1, 0.4, 0.7, 0.95):
        for cost in (0.05, 0.1, 0.4):
            assert group_width([rate], [4], cost) == 1 + best_k(rate, 4, cost)


def test_a_lone_repeater_among_plain_neighbours_stops_paying():
    # Alone, a sequence accepting 60% verifies 2-4 rows at a cheap row cost...
    assert group_width([0.6], [4], 0.1) > 1
    # ...beside three sequences with nothing to verify, its extra rows are paid 4 times.
    assert group_width([0.6, 0.5, 0.5, 0.5], [4, 0, 0, 0], 0.1) == 1
    # Where every sequence repeats itself, the group still speculates.
    assert group_width([0.9] * 4, [4] * 4, 0.1) > 1


def test_free_rows_verify_everything_offered():
    assert group_width([0.3, 0.8], [2, 5], 0.0) == 6
    assert capped([2, 5, 0], 3) == [2, 2, 0]


def test_costly_rows_never_speculate():
    assert group_width([0.99] * 2, [4, 4], 2.0) == 1
    assert forward_cost(1, 0.3) == 1.0


def test_a_group_gaining_less_than_min_gain_steps_plainly():
    # Four chat sequences with 1-gram matches (7% accepted) and nearly free rows: 4.28
    # tokens for 1.1 forwards at width 2 gains 3% over a plain step's 4 for 1.075.
    assert group_width([0.07] * 4, [1] * 4, 0.025) == 1
    assert group_width([0.3] * 4, [1] * 4, 0.025) == 2
