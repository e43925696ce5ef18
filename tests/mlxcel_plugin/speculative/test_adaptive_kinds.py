"""Per kind of proposal (the matched n-gram's size): its own rate and its own off-switch."""

from __future__ import annotations

from mlxcel_plugin.speculative.adaptive import AdaptiveController
from mlxcel_plugin.speculative.ngram import NgramIndex


def test_lookup_names_the_size_of_the_match_it_used():
    index = NgramIndex(1, 3, [5, 6, 7, 8, 9, 1, 5, 6, 7])
    assert index.lookup(2) == (3, [8, 9])
    index.extend([4, 9])  # "4 9" and "9" alone: only the 1-gram occurred before
    assert index.lookup(2) == (1, [1, 5])
    assert NgramIndex(1, 2, [1, 2, 3]).lookup(2) == (0, [])


def test_short_matches_that_miss_stop_proposing_while_long_ones_propose_the_most():
    control = AdaptiveController(k_max=4, row_cost=0.25)
    for _ in range(8):
        control.observe(control.proposal_limit(1), 0)  # every 1-gram proposal missed
        limit = control.proposal_limit(4)
        control.observe(limit, limit)  # every 4-gram proposal was the target's
    assert control.proposal_limit(1) == 0  # switched off for 1-gram matches...
    assert control.off_steps_left > 0
    assert control.proposal_limit(4) == 4  # ...not for 4-gram ones
    assert control.rate > 0.9
    assert control.proposal_limit(2) == 1  # an unseen kind starts from the prior


def test_one_kind_of_proposal_keeps_the_old_single_rate():
    control = AdaptiveController(k_max=4, row_cost=0.1)
    control.observe(control.proposal_limit(), 1)
    assert control.kind == 0
    assert control.rate == (0.8 * 1.0 + 1) / (0.8 * 2.0 + 2)
