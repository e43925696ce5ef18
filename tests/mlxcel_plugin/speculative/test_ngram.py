"""Prompt lookup: exact proposals from the latest earlier occurrence of the longest n-gram."""

from __future__ import annotations

import pytest

from mlxcel_plugin.speculative.ngram import NgramIndex


def test_proposes_what_followed_the_earlier_occurrence():
    index = NgramIndex(1, 3, [5, 6, 7, 8, 9, 1, 5, 6, 7])
    assert index.propose(3) == [8, 9, 1]
    assert index.propose(1) == [8]


def test_never_matches_its_own_suffix():
    index = NgramIndex(1, 3, [1, 2, 3])
    assert index.propose(4) == []  # "3" and "2 3" occurred only at the end


def test_longest_ngram_wins_over_a_later_shorter_match():
    # "7" last occurred before 4; "6 7" occurred before 8: the 2-gram decides.
    index = NgramIndex(1, 2, [6, 7, 8, 9, 7, 4, 6, 7])
    assert index.propose(2) == [8, 9]


def test_latest_occurrence_of_the_same_ngram_wins():
    index = NgramIndex(2, 2, [1, 2, 10, 1, 2, 20, 1, 2])
    assert index.propose(1) == [20]


def test_extend_keeps_the_index_current():
    index = NgramIndex(2, 3, [1, 2, 3, 4])
    assert index.propose(2) == []
    index.extend([1, 2])
    assert index.propose(2) == [3, 4]
    index.extend([3, 4, 5, 1, 2, 3])
    assert index.propose(3) == [4, 5, 1]  # "1 2 3" latest followed by 4 5 1


def test_proposal_stops_at_the_context_end_and_at_zero():
    index = NgramIndex(1, 1, [4, 9, 4])
    assert index.propose(5) == [9, 4]
    assert index.propose(0) == []


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        NgramIndex(3, 2)
    with pytest.raises(ValueError):
        NgramIndex(0, 2)
