"""Product modules stay under 400 lines and their functions under 50 (one concept per module)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT_PACKAGES = ("mlxcel_plugin", "engines", "router_plugin")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 50


def product_modules() -> list[Path]:
    return sorted(p for pkg in PRODUCT_PACKAGES for p in (REPO / pkg).rglob("*.py"))


def long_functions(source: str, max_lines: int = MAX_FUNCTION_LINES) -> list[str]:
    """``"name (N lines)"`` for each function or method longer than ``max_lines``.

    A function's length runs from its ``def`` (decorators excluded) to its last line,
    docstring and nested functions included.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > max_lines:
                found.append(f"{node.name} ({lines} lines)")
    return found


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("path", product_modules(), ids=_rel)
def test_module_is_short(path: Path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_MODULE_LINES, f"{_rel(path)}: {lines} lines > {MAX_MODULE_LINES}"


@pytest.mark.parametrize("path", product_modules(), ids=_rel)
def test_functions_are_short(path: Path):
    found = long_functions(path.read_text(encoding="utf-8"))
    assert not found, f"{_rel(path)}: functions over {MAX_FUNCTION_LINES} lines: {found}"


def test_long_function_check_counts_async_methods_and_nested_bodies():
    body = "\n".join(f"        x{i} = {i}" for i in range(50))
    source = f"class C:\n    async def run(self):\n{body}\n\n    def short(self):\n        pass\n"
    assert long_functions(source) == ["run (51 lines)"]
    assert long_functions(source, max_lines=51) == []
