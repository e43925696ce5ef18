"""The contract every balancer honours; run it on yours.

A balancer plugin registers ``factory(rng: random.Random) -> Balancer`` (see
``mlxcel_plugin.balancer_api``). Pass that factory to each check (or to
``run_contract``)::

    import pytest
    from mlxcel_plugin.testing.balancer_contract import CONTRACT_CHECKS

    @pytest.mark.parametrize("check", CONTRACT_CHECKS, ids=lambda check: check.__name__)
    def test_balancer_contract(check):
        check(MyBalancer)

A violated rule raises ``BalancerContractError`` naming the rule. Every check
is deterministic: seeded RNGs, fixed node sets, no clock.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from mlxcel_plugin.balancer_api import NodeView, RequestInfo
from mlxcel_plugin.errors import NoHealthyNodeError

Factory = Callable[[random.Random], Any]
SHORT_PROMPT_TOKENS = 16
LONG_PROMPT_TOKENS = 1_048_576  # the router's max_prompt_tokens
SELECTIONS = 40


class BalancerContractError(AssertionError):
    """A balancer broke a rule of the contract."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise BalancerContractError(message)


def _node(index: int, **fields: Any) -> NodeView:
    return NodeView(node_id=f"node-{index}", address=f"10.0.0.{index}:9000", **fields)


def _request(index: int, prompt_tokens: int = SHORT_PROMPT_TOKENS) -> RequestInfo:
    return RequestInfo(request_id=f"req-{index}", prompt_tokens=prompt_tokens, max_tokens=16)


def _seeded(factory: Factory, seed: int = 0) -> Any:
    return factory(random.Random(seed))


def _mixed_pool() -> list[NodeView]:
    """Healthy nodes with varied telemetry, and unhealthy ones that look the most attractive."""
    return [
        _node(0, queue_depth=3, active_sequences=5, free_kv_fraction=0.4, tokens_per_s=50.0),
        _node(1, healthy=False, free_kv_fraction=1.0, tokens_per_s=1000.0),
        _node(2, in_flight=1, free_kv_fraction=0.7, tokens_per_s=80.0),
        _node(3, healthy=False, free_kv_fraction=1.0, tokens_per_s=1000.0),
        _node(4, queue_depth=1, active_sequences=1, free_kv_fraction=0.9, tokens_per_s=20.0),
    ]


def _prompt_tokens(index: int) -> int:
    return LONG_PROMPT_TOKENS if index % 3 == 0 else SHORT_PROMPT_TOKENS


def _pick_ids(balancer: Any) -> list[str]:
    pool = _mixed_pool()
    picks = []
    for index in range(SELECTIONS):
        chosen = balancer.select(pool, _request(index, _prompt_tokens(index)))
        picks.append(chosen.node_id)
    return picks


def _pick_ids_with_global_seed(factory: Factory, global_seed: int) -> list[str]:
    """Picks of a balancer seeded 7 while the module-level ``random`` is seeded otherwise."""
    saved = random.getstate()
    try:
        random.seed(global_seed)
        return _pick_ids(_seeded(factory, 7))
    finally:
        random.setstate(saved)


def check_has_name(factory: Factory) -> None:
    name = getattr(_seeded(factory), "name", None)
    _check(isinstance(name, str) and bool(name), f"balancer name must be a non-empty str: {name!r}")


def check_never_picks_unhealthy(factory: Factory) -> None:
    balancer, pool = _seeded(factory), _mixed_pool()
    for index in range(SELECTIONS):
        chosen = balancer.select(pool, _request(index, _prompt_tokens(index)))
        _check(chosen in pool, f"picked {chosen!r}, which is not a candidate")
        _check(chosen.healthy, f"picked unhealthy node {chosen.node_id}")


def _expect_no_healthy(factory: Factory, candidates: list[Any], what: str) -> None:
    try:
        _seeded(factory).select(candidates, _request(0))
    except NoHealthyNodeError:
        return
    raise BalancerContractError(f"{what}: expected NoHealthyNodeError")


def check_empty_raises(factory: Factory) -> None:
    _expect_no_healthy(factory, [], "no candidates")


def check_all_unhealthy_raises(factory: Factory) -> None:
    pool = [_node(i, healthy=False) for i in range(3)]
    _expect_no_healthy(factory, pool, "all candidates unhealthy")


def check_single_node(factory: Factory) -> None:
    only = _node(7, queue_depth=100, free_kv_fraction=0.01)
    balancer = _seeded(factory)
    for index in range(SELECTIONS):
        chosen = balancer.select([only], _request(index, _prompt_tokens(index)))
        _check(chosen == only, "a single healthy candidate must always be picked")
    pool = [_node(1, healthy=False), only, _node(2, healthy=False)]
    chosen = _seeded(factory).select(pool, _request(0))
    _check(chosen == only, "the only healthy candidate among unhealthy ones must be picked")


def check_deterministic_given_rng(factory: Factory) -> None:
    """Every draw comes from the RNG the factory was given, never the ``random`` module."""
    first, second = _pick_ids_with_global_seed(factory, 1), _pick_ids_with_global_seed(factory, 2)
    _check(first == second, f"same rng seed, same calls, different picks: {first} vs {second}")


def check_does_not_mutate_candidates(factory: Factory) -> None:
    pool = _mixed_pool()
    before = list(pool)
    _seeded(factory).select(pool, _request(0))
    _check(pool == before, "select must not reorder or change the candidate list")


def check_follows_membership_changes(factory: Factory) -> None:
    balancer, pool = _seeded(factory), [_node(i) for i in range(4)]
    for index in range(SELECTIONS // 2):
        balancer.select(pool, _request(index))
    gone = pool.pop(1)
    pool[0] = _node(0, healthy=False)
    for index in range(SELECTIONS // 2):
        chosen = balancer.select(pool, _request(index, _prompt_tokens(index)))
        _check(chosen.node_id not in (gone.node_id, "node-0"), f"picked stale {chosen.node_id}")


def check_handles_missing_telemetry(factory: Factory) -> None:
    """Nodes that never reported (defaults everywhere) are still selectable."""
    pool = [_node(i) for i in range(3)]
    balancer = _seeded(factory)
    for prompt_tokens in (1, SHORT_PROMPT_TOKENS, LONG_PROMPT_TOKENS):
        chosen = balancer.select(pool, _request(prompt_tokens, prompt_tokens))
        _check(chosen in pool, "must pick a candidate when no telemetry has arrived")


CONTRACT_CHECKS: tuple[Callable[[Factory], None], ...] = (
    check_has_name,
    check_never_picks_unhealthy,
    check_empty_raises,
    check_all_unhealthy_raises,
    check_single_node,
    check_deterministic_given_rng,
    check_does_not_mutate_candidates,
    check_follows_membership_changes,
    check_handles_missing_telemetry,
)


def run_contract(factory: Factory) -> None:
    """Run every check; raises ``BalancerContractError`` on the first violation."""
    for check in CONTRACT_CHECKS:
        check(factory)
