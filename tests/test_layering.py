"""The layers hold: every product module's imports (function bodies included) obey docs/design.md.

Rules, by importing package:
* core (``mlxcel_plugin``) never imports ``engines``, ``router_plugin``, MLX or mlx-lm, and
  web frameworks only in the node processes (``mlxcel_plugin/nodes/``);
* the sans-I/O link protocol (``mlxcel_plugin/link/protocol/``) does no I/O: no asyncio,
  websockets or sockets;
* ``router_plugin`` never imports MLX, mlx-lm or ``engines`` (the router holds no weights);
* ``engines`` never imports ``router_plugin``;
* the router's HTTP front (``router_plugin/http``) knows nothing of the cluster or LiteLLM, and
  the cluster nothing of LiteLLM;
* no product module imports itself back through others (no import cycle).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT_PACKAGES = ("mlxcel_plugin", "engines", "router_plugin")
MLX = ("mlx", "mlx_lm")
WEB = ("fastapi", "starlette", "uvicorn")
IO = ("asyncio", "websockets", "socket")


@dataclass(frozen=True)
class Rule:
    """Modules under ``importer`` (dotted prefix) may not import any of ``forbidden``."""

    importer: str
    forbidden: tuple[str, ...]
    exempt: tuple[str, ...] = ()  # importer sub-packages the rule does not cover


RULES = (
    Rule("mlxcel_plugin", ("engines", "router_plugin", *MLX)),
    Rule("mlxcel_plugin", WEB, exempt=("mlxcel_plugin.nodes",)),
    Rule("mlxcel_plugin.link.protocol", IO),
    Rule("router_plugin", (*MLX, "engines")),
    Rule("engines", ("router_plugin",)),
    Rule("router_plugin.http", ("router_plugin.cluster", "router_plugin.litellm")),
    Rule("router_plugin.cluster", ("router_plugin.litellm",)),
)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def module_name(path: Path, root: Path = REPO) -> str:
    """Dotted name of a source file (``pkg/__init__.py`` is ``pkg``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """``(line, name)`` for every import in ``source``, function bodies included.

    Relative imports are resolved against ``module``; ``from pkg import sub`` is reported as
    ``pkg.sub`` (it may import that module), ``from pkg import *`` as ``pkg``.
    """
    package = module.split(".") if is_package else module.split(".")[:-1]
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names.extend(
                (node.lineno, prefix if alias.name == "*" else f"{prefix}.{alias.name}")
                for alias in node.names
            )
    return sorted(names)


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """``"module:line imports name (rule)"`` for each import that breaks a rule."""
    found = []
    for line, name in imported_names(source, module, is_package):
        for rule in RULES:
            if not _within(module, rule.importer):
                continue
            if any(_within(module, exempt) for exempt in rule.exempt):
                continue
            found.extend(
                f"{module}:{line} imports {name} ({rule.importer} -/-> {forbidden})"
                for forbidden in rule.forbidden
                if _within(name, forbidden)
            )
    return found


def product_modules() -> list[Path]:
    return sorted(p for pkg in PRODUCT_PACKAGES for p in (REPO / pkg).rglob("*.py"))


def test_product_tree_is_found():
    names = {module_name(p) for p in product_modules()}
    assert {"mlxcel_plugin.hookspecs", "router_plugin.http.front", "engines.mlx_engine"} <= names
    assert any(_within(n, "mlxcel_plugin.link.protocol") for n in names)


@pytest.mark.parametrize("path", product_modules(), ids=lambda p: module_name(p))
def test_module_respects_layers(path: Path):
    source = path.read_text(encoding="utf-8")
    found = violations(source, module_name(path), path.name == "__init__.py")
    assert not found, "layer violations:\n" + "\n".join(found)


SYNTHETIC = '''
import json
from engines.mlx_engine import MlxEngine

def lazy():
    import mlx.core as mx
    from ..router_plugin import front
    from fastapi import FastAPI
'''


def test_checker_catches_violations_in_function_bodies_and_relative_imports():
    found = violations(SYNTHETIC, "mlxcel_plugin.kv_serde")
    assert found == [
        "mlxcel_plugin.kv_serde:3 imports engines.mlx_engine.MlxEngine"
        " (mlxcel_plugin -/-> engines)",
        "mlxcel_plugin.kv_serde:6 imports mlx.core (mlxcel_plugin -/-> mlx)",
        "mlxcel_plugin.kv_serde:7 imports router_plugin.front (mlxcel_plugin -/-> router_plugin)",
        "mlxcel_plugin.kv_serde:8 imports fastapi.FastAPI (mlxcel_plugin -/-> fastapi)",
    ]


def test_web_frameworks_are_allowed_only_in_nodes():
    source = "import uvicorn\nfrom starlette.applications import Starlette\n"
    assert violations(source, "mlxcel_plugin.nodes.ops_http") == []
    assert len(violations(source, "mlxcel_plugin.config")) == 2


def test_sans_io_protocol_may_not_do_io():
    source = "def f():\n    import asyncio\nfrom websockets.asyncio.client import connect\n"
    assert len(violations(source, "mlxcel_plugin.link.protocol.frames")) == 2
    assert violations(source, "mlxcel_plugin.link.connection") == []


def test_router_and_engines_rules():
    assert violations("import mlx_lm", "router_plugin.http.front")
    assert violations("from engines import mlx_engine", "router_plugin.roles")
    assert violations("from router_plugin.balancers import base", "engines.mlx_engine")
    assert violations("from mlxcel_plugin.errors import MlxcelError", "engines.mlx_engine") == []


def test_relative_import_from_package_init_resolves_inside_package():
    names = imported_names("from .frames import Ping", "mlxcel_plugin.link.protocol", True)
    assert names == [(1, "mlxcel_plugin.link.protocol.frames.Ping")]
    names = imported_names("from . import frames", "mlxcel_plugin.link.protocol.records")
    assert names == [(1, "mlxcel_plugin.link.protocol.frames")]
    names = imported_names("from ..errors import *", "mlxcel_plugin.link.protocol.records")
    assert names == [(1, "mlxcel_plugin.link.errors")]


def import_graph() -> dict[str, set[str]]:
    """Product module -> the product modules it imports (function bodies included)."""
    modules = {module_name(p): p for p in product_modules()}
    graph = {}
    for name, path in modules.items():
        source = path.read_text(encoding="utf-8")
        targets = set()
        for _, target in imported_names(source, name, path.name == "__init__.py"):
            # ``from pkg import name`` names a module or an attribute of one.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not _within(name, target):
                targets.add(target)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as ``[a, b, ..., a]``, or ``[]`` (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return []


def test_no_import_cycle():
    assert find_cycle(import_graph()) == []


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []
