"""PowerOfTwoBalancer: the shared balancer contract plus exact-sequence tests."""

from __future__ import annotations

import random

import pytest
from mlxcel_plugin.balancer_api import NodeView, RequestInfo
from mlxcel_plugin.testing.balancer_contract import CONTRACT_CHECKS

from mlxcel_example_plugin import PowerOfTwoBalancer

REQUEST = RequestInfo(request_id="r", prompt_tokens=8)


def node(index: int, load: int = 0, healthy: bool = True) -> NodeView:
    return NodeView(f"node-{index}", f"10.0.0.{index}:9000", healthy=healthy, queue_depth=load)


class ScriptedDraws(random.Random):
    """An rng whose ``sample`` returns scripted pairs of node ids, to pin the rule exactly."""

    def __init__(self, pairs: list[tuple[str, str]]):
        super().__init__(0)
        self.pairs = list(pairs)

    def sample(self, population, k, **kwargs):
        by_id = {n.node_id: n for n in population}
        return [by_id[node_id] for node_id in self.pairs.pop(0)]


@pytest.mark.parametrize("check", CONTRACT_CHECKS, ids=lambda check: check.__name__)
def test_contract(check):
    check(PowerOfTwoBalancer)


def test_keeps_the_less_loaded_draw_and_the_first_on_a_tie():
    pool = [node(0, load=5), node(1, load=1), node(2, load=9), node(3, load=1)]
    draws = ScriptedDraws([("node-0", "node-1"), ("node-1", "node-2"), ("node-3", "node-1")])
    balancer = PowerOfTwoBalancer(draws)
    picks = [balancer.select(pool, REQUEST).node_id for _ in range(3)]
    assert picks == ["node-1", "node-1", "node-3"]


def test_exact_sequence_for_a_seed():
    # CPython's Mersenne Twister is stable across versions for Random(seed).sample.
    pool = [node(0, load=3), node(1, load=0), node(2, load=7), node(3, load=1)]
    balancer = PowerOfTwoBalancer(random.Random(42))
    picks = [balancer.select(pool, REQUEST).node_id for _ in range(8)]
    assert picks == ["node-3", "node-0", "node-1", "node-0", "node-0", "node-3", "node-3", "node-1"]


def test_never_picks_the_most_loaded_of_three_or_more():
    # Two distinct draws: the single most loaded node always loses its comparison.
    pool = [node(0, load=1), node(1, load=2), node(2, load=50)]
    balancer = PowerOfTwoBalancer(random.Random(1))
    assert all(balancer.select(pool, REQUEST).node_id != "node-2" for _ in range(100))


def test_two_nodes_always_gives_the_less_loaded():
    pool = [node(0, load=4), node(1, load=2)]
    balancer = PowerOfTwoBalancer(random.Random(5))
    assert {balancer.select(pool, REQUEST).node_id for _ in range(20)} == {"node-1"}


def test_unhealthy_nodes_are_never_drawn():
    pool = [node(0, load=9), node(1, healthy=False), node(2, load=8)]
    balancer = PowerOfTwoBalancer(random.Random(2))
    assert {balancer.select(pool, REQUEST).node_id for _ in range(20)} == {"node-2"}


def test_equal_loads_spread_over_the_pool():
    pool = [node(i) for i in range(4)]
    balancer = PowerOfTwoBalancer(random.Random(3))
    assert {balancer.select(pool, REQUEST).node_id for _ in range(40)} == {
        f"node-{i}" for i in range(4)
    }


def test_input_order_does_not_change_picks():
    pool = [node(0, load=3), node(1, load=0), node(2, load=7), node(3, load=1)]
    forward, backward = PowerOfTwoBalancer(random.Random(9)), PowerOfTwoBalancer(random.Random(9))
    for _ in range(10):
        assert forward.select(pool, REQUEST) == backward.select(pool[::-1], REQUEST)
