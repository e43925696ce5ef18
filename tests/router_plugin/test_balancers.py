"""Exact-sequence tests for the built-in balancers, and the contract's own checks."""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pluggy
import pytest

from mlxcel_plugin import hookspecs
from mlxcel_plugin.balancer_api import NodeView, RequestInfo
from mlxcel_plugin.errors import NoHealthyNodeError
from mlxcel_plugin.plugins import collect
from mlxcel_plugin.testing.balancer_contract import (
    BalancerContractError,
    check_deterministic_given_rng,
    run_contract,
)
from router_plugin import plugin as router_plugin_module
from router_plugin.balancers import (
    LeastLoadedBalancer,
    MemoryAwareBalancer,
    PrefixAwareBalancer,
    PromptLengthAwareBalancer,
    RoundRobinBalancer,
)

SHORT = RequestInfo("short", prompt_tokens=16)
LONG = RequestInfo("long", prompt_tokens=4096)


def node(index: int, **fields) -> NodeView:
    return NodeView(node_id=f"decode-{index}", address=f"10.0.0.{index}:9000", **fields)


def ids(nodes) -> list[str]:
    return [n.node_id for n in nodes]


def _router_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(router_plugin_module)
    return pm


def registered_balancers() -> dict:
    return collect(_router_plugin_manager()).entries["balancer"]


# --- registration ---------------------------------------------------------------


def test_router_plugin_registers_the_five_balancers_by_name():
    factories = registered_balancers()
    assert sorted(factories) == [
        "least-loaded",
        "memory-aware",
        "prefix-aware",
        "prompt-length-aware",
        "round-robin",
    ]
    assert all(factories[name](random.Random(0)).name == name for name in factories)


# --- contract (tests/contracts runs it on every installed balancer) ----------------


def test_contract_catches_a_balancer_that_picks_unhealthy_nodes():
    class PicksFirst:
        name = "picks-first"

        def __init__(self, rng: random.Random):
            pass

        def select(self, candidates, request):
            if not candidates:
                raise NoHealthyNodeError("none")
            return candidates[0]

    with pytest.raises(BalancerContractError, match="unhealthy"):
        run_contract(PicksFirst)


def test_contract_catches_a_balancer_that_draws_from_the_random_module():
    class GlobalRandom:
        name = "global-random"

        def __init__(self, rng: random.Random):
            pass

        def select(self, candidates, request):
            return random.choice([n for n in candidates if n.healthy])

    with pytest.raises(BalancerContractError, match="same rng seed"):
        check_deterministic_given_rng(GlobalRandom)


@pytest.mark.parametrize(
    "balancer_class",
    [RoundRobinBalancer, LeastLoadedBalancer, MemoryAwareBalancer, PromptLengthAwareBalancer,
     PrefixAwareBalancer],
)
def test_a_balancer_built_without_an_rng_gets_its_own(balancer_class):
    pool = [node(0), node(1), node(2, healthy=False)]
    assert balancer_class().select(pool, SHORT).node_id in {"decode-0", "decode-1"}


def test_the_router_gives_each_pool_an_rng_seeded_from_router_seed():
    from router_plugin.roles import _balancers

    registry = collect(_router_plugin_manager())
    config = SimpleNamespace(prefill_balancer="least-loaded", decode_balancer="least-loaded")
    by_role = _balancers(config, registry, seed=5)
    pool = [node(0), node(1), node(2)]
    for role, seed in (("prefill", 5), ("decode", 6)):
        expected = LeastLoadedBalancer(random.Random(seed))
        picks = [by_role[role].select(pool, SHORT).node_id for _ in range(8)]
        assert picks == [expected.select(pool, SHORT).node_id for _ in range(8)]


# --- round robin ----------------------------------------------------------------


def test_round_robin_cycles_in_stable_id_order_regardless_of_input_order():
    pool = [node(2), node(0), node(10), node(1)]
    balancer = RoundRobinBalancer(random.Random(0))
    picks = [balancer.select(pool, SHORT).node_id for _ in range(6)]
    assert picks == ["decode-0", "decode-1", "decode-2", "decode-10", "decode-0", "decode-1"]


def test_round_robin_skips_unhealthy_and_keeps_its_place_when_membership_changes():
    pool = [node(0), node(1), node(2), node(3)]
    balancer = RoundRobinBalancer(random.Random(0))
    picks = [balancer.select(pool, SHORT).node_id for _ in range(2)]
    pool[2] = node(2, healthy=False)
    picks += [balancer.select(pool, SHORT).node_id for _ in range(2)]
    pool = pool[1:]  # decode-0 leaves
    picks += [balancer.select(pool, SHORT).node_id for _ in range(3)]
    assert picks == [
        "decode-0",
        "decode-1",
        "decode-3",
        "decode-0",
        "decode-1",
        "decode-3",
        "decode-1",
    ]


def test_round_robin_ignores_telemetry():
    pool = [node(0, queue_depth=50), node(1)]
    balancer = RoundRobinBalancer(random.Random(0))
    assert [balancer.select(pool, SHORT).node_id for _ in range(3)] == [
        "decode-0",
        "decode-1",
        "decode-0",
    ]


# --- least loaded ---------------------------------------------------------------


def test_least_loaded_sums_queue_depth_active_sequences_and_router_in_flight():
    pool = [
        node(0, queue_depth=2, active_sequences=1),  # 3
        node(1, active_sequences=1, in_flight=1),  # 2
        node(2, queue_depth=1, in_flight=3),  # 4
    ]
    assert LeastLoadedBalancer(random.Random(0)).select(pool, SHORT).node_id == "decode-1"


def test_least_loaded_breaks_ties_with_the_rng_exact_sequence():
    pool = [node(0), node(1), node(2)]
    balancer = LeastLoadedBalancer(random.Random(1))
    picks = [balancer.select(pool, SHORT).node_id for _ in range(6)]
    assert picks == ["decode-0", "decode-2", "decode-0", "decode-1", "decode-0", "decode-1"]


def test_least_loaded_spreads_a_burst_as_the_router_counts_dispatches():
    pool = {n.node_id: n for n in (node(0), node(1, queue_depth=1), node(2))}
    balancer = LeastLoadedBalancer(random.Random(5))
    picks = []
    for _ in range(5):
        chosen = balancer.select(list(pool.values()), SHORT)
        pool[chosen.node_id] = replace(chosen, in_flight=chosen.in_flight + 1)
        picks.append(chosen.node_id)
    # Random(5) breaks the ties 0/2 -> 2, then 0/1/2 -> 2, then 0/1 -> 1.
    assert picks == ["decode-2", "decode-0", "decode-2", "decode-1", "decode-0"]
    assert [n.load for n in pool.values()] == [2, 2, 2]


# --- memory aware ---------------------------------------------------------------


def test_memory_aware_picks_most_free_kv_then_least_loaded():
    pool = [
        node(0, free_kv_fraction=0.5),
        node(1, free_kv_fraction=0.8, queue_depth=3),
        node(2, free_kv_fraction=0.8, queue_depth=1),
        node(3, free_kv_fraction=0.9, healthy=False),
    ]
    assert MemoryAwareBalancer(random.Random(0)).select(pool, SHORT).node_id == "decode-2"


def test_memory_aware_full_ties_use_the_seeded_rng_exact_sequence():
    pool = [node(0, free_kv_fraction=0.7), node(1, free_kv_fraction=0.7)]
    balancer = MemoryAwareBalancer(random.Random(3))
    picks = [balancer.select(pool, SHORT).node_id for _ in range(5)]
    again = MemoryAwareBalancer(random.Random(3))
    assert picks == [again.select(pool, SHORT).node_id for _ in range(5)]
    assert picks == ["decode-0", "decode-0", "decode-1", "decode-1", "decode-0"]


# --- prompt length aware --------------------------------------------------------


def test_prompt_length_aware_sends_long_prompts_to_least_loaded_then_most_capable():
    pool = [
        node(0, queue_depth=2, tokens_per_s=500.0),
        node(1, active_sequences=1, tokens_per_s=40.0),
        node(2, in_flight=1, tokens_per_s=90.0),
    ]
    assert PromptLengthAwareBalancer(random.Random(0)).select(pool, LONG).node_id == "decode-2"


def test_prompt_length_aware_threshold_is_inclusive():
    pool = [node(0, queue_depth=1), node(1)]
    balancer = PromptLengthAwareBalancer(random.Random(0), long_prompt_tokens=100)
    at_threshold = RequestInfo("r", prompt_tokens=100)
    assert [balancer.select(pool, at_threshold).node_id for _ in range(3)] == ["decode-1"] * 3


def test_prompt_length_aware_spreads_short_prompts_with_two_choices_exact_sequence():
    # loads: 4, 1, 0, 2; Random(1) draws index pairs (1,2) (0,1) (0,1) (3,1) (3,0) (0,1).
    pool = [node(0, queue_depth=4), node(1, queue_depth=1), node(2), node(3, active_sequences=2)]
    balancer = PromptLengthAwareBalancer(random.Random(1))
    picks = [balancer.select(pool, SHORT).node_id for _ in range(6)]
    assert picks == ["decode-2", "decode-1", "decode-1", "decode-1", "decode-3", "decode-1"]


def test_prompt_length_aware_rejects_a_nonsense_threshold():
    with pytest.raises(ValueError):
        PromptLengthAwareBalancer(random.Random(0), long_prompt_tokens=0)


@pytest.mark.parametrize(
    "balancer_class",
    [RoundRobinBalancer, LeastLoadedBalancer, MemoryAwareBalancer, PromptLengthAwareBalancer],
)
def test_no_healthy_node_is_an_at_capacity_error_with_retry_after(balancer_class):
    with pytest.raises(NoHealthyNodeError) as info:
        balancer_class(random.Random(0)).select([node(0, healthy=False)], SHORT)
    assert info.value.status_code == 503
    assert info.value.retry_after_s > 0


# --- prefix-aware ------------------------------------------------------------------


def test_prefix_aware_follows_the_longest_cached_prefix():
    pool = [node(0, cached_prefix_tokens=512), node(1, cached_prefix_tokens=1536), node(2)]
    assert PrefixAwareBalancer(random.Random(0)).select(pool, LONG).node_id == "decode-1"


def test_prefix_aware_prefers_the_least_loaded_holder_of_a_shared_prefix():
    pool = [node(0, cached_prefix_tokens=1024, in_flight=3),
            node(1, cached_prefix_tokens=1024, in_flight=1), node(2, in_flight=0)]
    assert PrefixAwareBalancer(random.Random(0)).select(pool, LONG).node_id == "decode-1"


def test_prefix_aware_skips_a_holder_far_busier_than_the_idlest():
    # 5 more requests than the idlest node: not "near" it, though the pool is balanced
    # (15 is not more than 1.5 x 10).
    pool = [node(0, cached_prefix_tokens=2048, in_flight=15), node(1, in_flight=10),
            node(2, cached_prefix_tokens=512, in_flight=11)]
    assert PrefixAwareBalancer(random.Random(0)).select(pool, LONG).node_id == "decode-2"


def test_prefix_aware_falls_back_to_least_loaded_when_the_pool_is_imbalanced():
    pool = [node(0, cached_prefix_tokens=2048, in_flight=1), node(1, in_flight=9),
            node(2, in_flight=0)]
    # 9 - 0 > 4 and 9 > 1.5 * 0: imbalanced, so the idlest wins over the cached prefix.
    assert PrefixAwareBalancer(random.Random(0)).select(pool, LONG).node_id == "decode-2"


def test_prefix_aware_without_any_cached_prefix_is_least_loaded_with_seeded_ties():
    pool = [node(0), node(1), node(2, in_flight=1)]
    balancer = PrefixAwareBalancer(random.Random(7))
    sequence = [balancer.select(pool, SHORT).node_id for _ in range(8)]
    assert set(sequence) == {"decode-0", "decode-1"}  # never the busier one; both tied
    again = PrefixAwareBalancer(random.Random(7))
    assert [again.select(pool, SHORT).node_id for _ in range(8)] == sequence
