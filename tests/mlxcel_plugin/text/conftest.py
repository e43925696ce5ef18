"""Fixtures for the text pipeline: SmolLM2's tokenizer, from the tiny checkpoint."""

from __future__ import annotations

import pytest

from mlxcel_plugin.text import TextTokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tiny_model_path) -> str:
    return str(tiny_model_path)


@pytest.fixture(scope="session")
def text_tokenizer(tokenizer_dir: str) -> TextTokenizer:
    return TextTokenizer.from_dir(tokenizer_dir)
