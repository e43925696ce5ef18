"""ModelSet over fake engines: load on first use, LRU eviction of idle models only, a bounded
wait then 503 while the loaded models are busy, loads that outlive their requester."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import pytest

from mlxcel_plugin.errors import AtCapacityError, EngineError
from mlxcel_plugin.scheduling.model_residency import ResidencyLimits
from mlxcel_plugin.scheduling.model_set import RETRY_AFTER_S, ModelSet

DEADLINE_S = 10


class FakeEngine:
    def __init__(self, name: str):
        self.name, self.closed = name, False

    def close(self) -> None:
        self.closed = True


class Loader:
    """Loads fake engines; ``gate`` (when set) holds each load until released."""

    def __init__(self, fail: set[str] | None = None):
        self.fail = fail or set()
        self.gate: threading.Event | None = None
        self.loaded: list[FakeEngine] = []

    def __call__(self, name: str, path: str) -> FakeEngine:
        if self.gate is not None:
            self.gate.wait(DEADLINE_S)
        if name in self.fail:
            raise OSError(f"cannot read {path}")
        engine = FakeEngine(name)
        self.loaded.append(engine)
        return engine


def model_set(loader: Loader, max_loaded: int = 1, wait_s: float = DEADLINE_S) -> ModelSet:
    paths = {"a": "/models/a", "b": "/models/b"}
    return ModelSet(paths, {"a": 10, "b": 10}, ResidencyLimits(max_loaded), loader, wait_s=wait_s)


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), DEADLINE_S))


async def until(check: Callable[[], bool]) -> None:
    while not check():
        await asyncio.sleep(0.01)


def test_loads_on_first_use_and_evicts_the_idle_one() -> None:
    async def scenario() -> None:
        loader = Loader()
        models = model_set(loader)
        assert models.status() == {"a": False, "b": False}
        async with models.lease("a") as engine_a:
            assert engine_a.name == "a"
        async with models.lease("b") as engine_b:
            assert engine_b.name == "b" and engine_a.closed
        assert models.status() == {"a": False, "b": True}
        assert (models.counts["a"].loads, models.counts["a"].evictions) == (1, 1)
        async with models.lease("a"):
            assert models.counts["a"].loads == 2 and engine_b.closed
        await models.close()

    run(scenario)


def test_a_request_waits_while_the_loaded_model_streams() -> None:
    async def scenario() -> None:
        models = model_set(Loader())
        async with models.lease("a") as engine_a:
            waiter = asyncio.create_task(_lease_once(models, "b"))
            await until(lambda: models.counts["b"].waits == 1)
            assert not engine_a.closed and models.status() == {"a": True, "b": False}
        assert (await waiter).name == "b"
        assert engine_a.closed and models.counts["a"].evictions == 1
        await models.close()

    run(scenario)


def test_refused_with_a_retry_hint_after_the_wait() -> None:
    async def scenario() -> None:
        models = model_set(Loader(), wait_s=0)
        async with models.lease("a") as engine_a:
            with pytest.raises(AtCapacityError, match="model b is not loaded") as refused:
                await _lease_once(models, "b")
        assert refused.value.retry_after_s == RETRY_AFTER_S and refused.value.status_code == 503
        assert not engine_a.closed and models.counts["b"].refusals == 1
        await models.close()

    run(scenario)


def test_a_load_outlives_the_request_that_started_it() -> None:
    async def scenario() -> None:
        loader = Loader()
        loader.gate = threading.Event()
        models = model_set(loader)
        first = asyncio.create_task(_lease_once(models, "a"))
        await until(lambda: models.residency.is_loading("a"))
        first.cancel()  # the client went away mid-load
        loader.gate.set()
        await until(lambda: models.status()["a"])
        async with models.lease("a") as engine:
            assert engine is loader.loaded[0] and len(loader.loaded) == 1
        await models.close()
        assert engine.closed

    run(scenario)


def test_a_failed_load_is_an_engine_error_and_the_next_request_tries_again() -> None:
    async def scenario() -> None:
        loader = Loader(fail={"b"})
        models = model_set(loader)
        with pytest.raises(EngineError, match="model b could not be loaded: cannot read"):
            await _lease_once(models, "b")
        assert models.status() == {"a": False, "b": False}
        assert models.counts["b"].load_failures == 1
        loader.fail.clear()
        assert (await _lease_once(models, "b")).name == "b"
        await models.close()

    run(scenario)


async def _lease_once(models: ModelSet, name: str) -> FakeEngine:
    async with models.lease(name) as engine:
        return engine


def test_load_on_start_loads_what_fits_without_evicting() -> None:
    async def scenario() -> None:
        models = model_set(Loader(), max_loaded=1)
        await models.start(load_all=True)
        assert models.status() == {"a": True, "b": False}
        assert models.counts["a"].evictions == 0
        await models.close()
        lazy = model_set(Loader(), max_loaded=1)
        await lazy.start(load_all=False)
        assert lazy.status() == {"a": False, "b": False}

    run(scenario)
