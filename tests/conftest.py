"""Shared fixtures: model checkpoints built once per machine (engines import MLX lazily)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def model_cache_root() -> Path:
    """``MLXCEL_CACHE_DIR`` when set, else the repo's git-ignored ``.cache/``."""
    env = os.environ.get("MLXCEL_CACHE_DIR")
    return Path(env) if env else REPO / ".cache" / "mlxcel"


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from engines.model_store import ensure_tiny_model

    return ensure_tiny_model(root=model_cache_root())


@pytest.fixture(scope="session")
def smollm2_model_path() -> Path:
    from engines.model_store import ensure_default_model

    return ensure_default_model(root=model_cache_root())


@pytest.fixture(scope="session")
def tokenizer_dir(tiny_model_path) -> str:
    """SmolLM2's tokenizer and chat template, from the tiny checkpoint (no weights read)."""
    return str(tiny_model_path)


@pytest.fixture(scope="session")
def text_tokenizer(tokenizer_dir: str):
    from mlxcel_plugin.text import TextTokenizer

    return TextTokenizer.from_dir(tokenizer_dir)
