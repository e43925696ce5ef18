"""ModelResidency: which idle model goes (LRU), never a busy one, under a count or memory bound."""

from __future__ import annotations

import pytest

from mlxcel_plugin.errors import ConfigError
from mlxcel_plugin.scheduling.model_residency import LoadPlan, ModelResidency, ResidencyLimits

MB = 1_000_000


def loaded(residency: ModelResidency, *names: str) -> ModelResidency:
    for name in names:
        residency.loading_started(name)
        residency.loading_ended(name, True)
    return residency


def test_count_bound_evicts_the_least_recently_used_idle_model() -> None:
    residency = loaded(ModelResidency({"a": MB, "b": MB, "c": MB}, ResidencyLimits(2)), "a", "b")
    residency.touch("b")
    residency.touch("a")  # b is now the least recently used
    plan = residency.plan("c")
    assert plan == LoadPlan(("b",), "2 loaded = --max-loaded-models 2")


def test_a_busy_model_is_never_evicted() -> None:
    residency = loaded(ModelResidency({"a": MB, "b": MB}, ResidencyLimits(1)), "a")
    residency.begin("a")  # a request running (or queued) on a
    assert residency.plan("b") is None
    residency.end("a")
    assert residency.plan("b") == LoadPlan(("a",), "1 loaded = --max-loaded-models 1")


def test_a_loading_model_counts_and_cannot_be_evicted() -> None:
    residency = ModelResidency({"a": MB, "b": MB}, ResidencyLimits(1))
    residency.loading_started("a")
    assert residency.plan("b") is None


def test_memory_bound_evicts_until_the_weights_fit() -> None:
    limits = ResidencyLimits(memory_bytes=5 * MB)
    residency = loaded(ModelResidency({"a": 2 * MB, "b": 2 * MB, "c": 3 * MB}, limits), "a", "b")
    residency.touch("a")
    plan = residency.plan("c")
    assert plan is not None and plan.evict == ("b",)
    assert plan.reason == "7 MiB of weights > --model-memory-bytes 5 MiB"
    assert residency.plan("a") == LoadPlan(())  # loaded already: nothing to evict


def test_no_bound_needs_no_eviction() -> None:
    residency = loaded(ModelResidency({"a": MB, "b": MB}, ResidencyLimits()), "a")
    assert residency.plan("b") == LoadPlan(())


def test_a_model_larger_than_the_budget_is_a_startup_error() -> None:
    with pytest.raises(ConfigError, match="model big .* does not fit"):
        ModelResidency({"big": 10 * MB}, ResidencyLimits(memory_bytes=5 * MB))
