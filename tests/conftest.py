"""Shared fixtures: model checkpoints built once per machine (engines import MLX lazily)."""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxcel_plugin.gc_pauses import freeze_startup_heap
from tests import openblas_child

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
# `scripts/test.sh --quick` runs `-m quick`: the pure core, the router's parts, the contracts and
# the repository checks, in this process (no node processes, no network namespaces).
QUICK_PATHS = ("mlxcel_plugin", "router_plugin", "contracts", "deploy", "test_code_size.py",
               "test_layering.py", "test_doc_citations.py")
NOT_QUICK = ("mlxcel_plugin/testing/test_netns.py",)


def _is_quick(path: Path) -> bool:
    relative = path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else ""
    return relative.split("/")[0] in QUICK_PATHS and relative not in NOT_QUICK


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m quick``, the other modules are not even imported (MLX, litellm, locust)."""
    if config.getoption("markexpr") != "quick" or collection_path.parent != TESTS:
        return None
    if collection_path.name in ("conftest.py", "__init__.py"):
        return None
    return None if _is_quick(collection_path) else True


# Modules that start node processes, slowest first (SmolLM2's): under pytest-xdist
# (`--dist loadfile --no-loadscope-reorder`, scripts/test.sh) each worker takes the next module
# in this order, so the long ones start early and the many short in-process ones fill the end,
# instead of one long module running alone on one worker while the other idles.
PROCESS_DIRS = ("integration", "chaos", "loadtests", "engines/sharding")


def _start_rank(item: pytest.Item) -> int:
    if item.get_closest_marker("smollm2"):
        return 0
    relative = item.path.relative_to(TESTS).as_posix() if item.path.is_relative_to(TESTS) else ""
    return 1 if relative.startswith(PROCESS_DIRS) else 2


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _is_quick(item.path):
            item.add_marker(pytest.mark.quick)
    module_rank: dict[Path, int] = {}
    for item in items:
        module_rank[item.path] = min(module_rank.get(item.path, 2), _start_rank(item))
    items.sort(key=lambda item: module_rank[item.path])  # stable: a module's order is kept


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection left (every test module, its libraries, ~5,000 items) out of the
    collector's scans, as a node freezes its start-up heap (mlxcel_plugin/gc_pauses.py): full
    collections that walked it all took ~4% of the suite's CPU."""
    freeze_startup_heap()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """Tests marked ``openblas_child`` run in a child with OpenBLAS under MLX (its module says
    why); the others as usual."""
    env = openblas_child.child_env(item)
    if env is None:
        return None
    openblas_child.run_protocol(item, env)
    return True


def model_cache_root() -> Path:
    """``MLXCEL_CACHE_DIR`` when set, else the repo's git-ignored ``.cache/``."""
    env = os.environ.get("MLXCEL_CACHE_DIR")
    return Path(env) if env else REPO / ".cache" / "mlxcel"


@pytest.fixture(scope="session", autouse=True)
def _one_reuse_probe_per_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Engines started by this run, in process or as nodes, keep the reuse probe's answer here.

    A node probes its model once (5-12 s) and every later start of the same model and settings
    reads the answer (engines/prefix/probe_cache.py); the directory is this run's own, shared by
    pytest-xdist's workers, so no run depends on what an earlier one left behind.
    """
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    directory = shared / "reuse-probe"
    directory.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLXCEL_PROBE_CACHE_DIR", str(directory))
        yield directory


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--spawn-nodes", action="store_true",
                     help="start every node as `python -m mlxcel_plugin.cli` (no forkserver)")


@pytest.fixture(scope="session", autouse=True)
def _nodes_forked_from_a_forkserver(request: pytest.FixtureRequest) -> None:
    """Nodes started through local_cluster.start_node are forked from a forkserver that
    imported transformers, mlx-lm and FastAPI once (~2 of a node's 3 CPU-s of start-up:
    mlxcel_plugin/node_forkserver.py); a node whose environment changes what those read
    at import is still spawned, and so is every node under ``--spawn-nodes``."""
    from mlxcel_plugin import local_cluster

    if not request.config.getoption("--spawn-nodes"):
        local_cluster.fork_nodes()


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
