"""Fixtures for the front: a scripted engine (the tokenizer fixtures are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from mlxcel_plugin.testing.fake_engine import FakeEngine, Script


@pytest.fixture
def make_engine() -> Iterator[Callable[..., FakeEngine]]:
    engines: list[FakeEngine] = []

    def make(script: Script, **kwargs) -> FakeEngine:
        engine = FakeEngine.scripted(script, **kwargs)
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
