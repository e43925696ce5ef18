"""Shared fixtures: model checkpoints built once per machine (engines import MLX lazily)."""

from __future__ import annotations

import gc
import logging
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


class _NeverRetrieved(logging.Handler):
    """asyncio's "Future/Task exception was never retrieved" records (logged when one is freed)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "exception was never retrieved" in message:
            self.messages.append(message[:500])

    def take(self) -> list[str]:
        messages, self.messages = self.messages, []
        return messages


_never_retrieved = _NeverRetrieved()
logging.getLogger("asyncio").addHandler(_never_retrieved)


@pytest.fixture(autouse=True, scope="module")
def _no_never_retrieved_in_module():
    """Futures kept alive by a reference cycle are freed only by the collector: once a module."""
    yield
    gc.collect()
    if messages := _never_retrieved.take():
        pytest.fail("asyncio exception never retrieved: " + " | ".join(messages))


@pytest.fixture(autouse=True)
def _no_never_retrieved():
    yield
    if messages := _never_retrieved.take():
        pytest.fail("asyncio exception never retrieved: " + " | ".join(messages))
