"""Fixtures for the front: SmolLM2's tokenizer (from the tiny checkpoint) and a scripted engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from mlxcel_plugin.testing.fake_engine import FakeEngine, Script
from mlxcel_plugin.text import TextTokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tiny_model_path) -> str:
    return str(tiny_model_path)


@pytest.fixture(scope="session")
def text_tokenizer(tokenizer_dir: str) -> TextTokenizer:
    return TextTokenizer.from_dir(tokenizer_dir)


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
