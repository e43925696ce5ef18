"""The layers hold: every product module's imports (function bodies included) obey docs/design.md.

Rules, by importing package:
* core (``mlxcel_plugin``) never imports ``engines``, ``router_plugin``, MLX or mlx-lm, and
  web frameworks only in the node processes (``mlxcel_plugin/nodes/``);
* the sans-I/O link protocol (``mlxcel_plugin/link/protocol/``) does no I/O: no asyncio,
  websockets or sockets;
* ``router_plugin`` never imports MLX, mlx-lm or ``engines`` (the router holds no weights);
* ``engines`` never imports ``router_plugin``.
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
    assert {"mlxcel_plugin.hookspecs", "router_plugin.front", "engines.mlx_engine"} <= names
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
    assert violations("import mlx_lm", "router_plugin.front")
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
