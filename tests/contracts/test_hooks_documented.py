"""Every hook is documented and covered by a contract suite run here (as datasette checks its own).

A hookspec in ``mlxcel_plugin/hookspecs.py`` needs: a docstring in the pytest
hookspec shape; a row in the plugin section of ``docs/plugins.md``; a registry kind in
``plugins.KINDS`` (or nothing ever calls it); a contract suite in
``mlxcel_plugin/testing/`` (``HOOK_SUITES`` below says which); and a module in
``tests/contracts/`` that imports that suite and runs it over every registered
name of the hook's kind (``REGISTRY.names(kind)``). Adding a hook without all
of them fails here, naming what is missing.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from mlxcel_plugin import hookspecs
from mlxcel_plugin.plugins import KINDS

REPO = Path(__file__).resolve().parents[2]
CONTRACT_TESTS = Path(__file__).resolve().parent
PLUGIN_PAGE = REPO / "docs" / "plugins.md"
PLUGIN_SECTION = "## Writing a plugin"

# hook -> (module in mlxcel_plugin.testing, the suite a plugin author runs)
HOOK_SUITES = {
    "mlxcel_register_engines": ("engine_contract", "EngineContract"),
    "mlxcel_register_balancers": ("balancer_contract", "CONTRACT_CHECKS"),
    "mlxcel_register_transfer_strategies": ("transfer_contract", "TransferStrategyContract"),
    "mlxcel_register_kv_codecs": ("codec_contract", "CodecContract"),
    "mlxcel_register_roles": ("role_contract", "RoleContract"),
    "mlxcel_register_discovery": ("discovery_contract", "DiscoveryContract"),
}
KIND_OF_HOOK = {hook: kind for kind, hook in KINDS.items()}


def hook_names() -> list[str]:
    marker = f"{hookspecs.PROJECT_NAME}_spec"
    return sorted(
        name
        for name, function in inspect.getmembers(hookspecs, inspect.isfunction)
        if hasattr(function, marker)
    )


def plugin_section(page: str) -> str:
    """The plugin section of a page: from its heading to the next ``## `` heading."""
    start = page.index(PLUGIN_SECTION)
    end = page.find("\n## ", start + len(PLUGIN_SECTION))
    return page[start : end if end != -1 else len(page)]


def runs_suite(source: str, module: str, suite: str, kind: str) -> bool:
    """True if ``source`` imports ``suite`` from ``mlxcel_plugin.testing.<module>`` and
    iterates the registry's names of ``kind`` (``REGISTRY.names("<kind>")``)."""
    imports_suite = names_kind = False
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == f"mlxcel_plugin.testing.{module}":
            imports_suite = imports_suite or any(alias.name == suite for alias in node.names)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            args = node.args
            names_kind = names_kind or (
                node.func.attr == "names"
                and len(args) == 1
                and isinstance(args[0], ast.Constant)
                and args[0].value == kind
            )
    return imports_suite and names_kind


def contract_sources() -> dict[str, str]:
    return {path.name: path.read_text(encoding="utf-8") for path in CONTRACT_TESTS.glob("*.py")}


def coverage_gaps(hook: str, sources: dict[str, str]) -> list[str]:
    """What ``hook`` lacks to count as covered (empty when it is)."""
    if hook not in HOOK_SUITES:
        return [f"{hook}: no contract suite; add one to mlxcel_plugin/testing/ and HOOK_SUITES"]
    if hook not in KIND_OF_HOOK:
        return [f"{hook}: not in mlxcel_plugin.plugins.KINDS, so nothing ever calls it"]
    module, suite = HOOK_SUITES[hook]
    kind = KIND_OF_HOOK[hook]
    gaps = []
    if not hasattr(importlib.import_module(f"mlxcel_plugin.testing.{module}"), suite):
        gaps.append(f"{hook}: mlxcel_plugin.testing.{module} has no {suite}")
    if not any(runs_suite(source, module, suite, kind) for source in sources.values()):
        gaps.append(f"{hook}: no tests/contracts/ module runs {suite} over names({kind!r})")
    return gaps


def test_hookspecs_are_found():
    assert len(hook_names()) >= 5
    assert "mlxcel_register_roles" in hook_names()


@pytest.mark.parametrize("hook", hook_names())
def test_hook_is_covered_by_a_contract_suite(hook):
    gaps = coverage_gaps(hook, contract_sources())
    assert not gaps, "\n".join(gaps)


@pytest.mark.parametrize("hook", hook_names())
def test_hook_is_documented_in_the_plugin_page(hook):
    section = plugin_section(PLUGIN_PAGE.read_text(encoding="utf-8"))
    assert f"`{hook}`" in section, f"{hook} is missing from docs/plugins.md's plugin section"


@pytest.mark.parametrize("hook", hook_names())
def test_hook_docstring_has_the_hookspec_shape(hook):
    doc = inspect.getdoc(getattr(hookspecs, hook)) or ""
    for part in (":param register:", ":return:", "Example::", "@hookimpl"):
        assert part in doc, f"{hook}'s docstring lacks {part!r}"


def test_every_suite_belongs_to_a_hook():
    assert set(HOOK_SUITES) <= set(hook_names())


# --- the checks themselves catch what they should ------------------------------------

COVERING = '''
from mlxcel_plugin.testing.role_contract import RoleContract
class TestRoles(RoleContract):
    @pytest.fixture(params=REGISTRY.names("role"))
    def role(self, request): ...
'''


def test_a_hook_without_a_suite_is_reported():
    assert coverage_gaps("mlxcel_register_tokenizers", {}) == [
        "mlxcel_register_tokenizers: no contract suite; add one to mlxcel_plugin/testing/"
        " and HOOK_SUITES"
    ]


def test_a_suite_nobody_runs_is_reported():
    gaps = coverage_gaps("mlxcel_register_roles", {"only_imports.py": COVERING.split("class")[0]})
    assert gaps == ["mlxcel_register_roles: no tests/contracts/ module runs RoleContract over "
                    "names('role')"]  # fmt: skip
    assert coverage_gaps("mlxcel_register_roles", {"covering.py": COVERING}) == []


def test_runs_suite_needs_both_the_import_and_the_kind():
    assert runs_suite(COVERING, "role_contract", "RoleContract", "role")
    assert not runs_suite(COVERING, "role_contract", "RoleContract", "engine")
    assert not runs_suite(COVERING, "codec_contract", "RoleContract", "role")


def test_plugin_section_stops_at_the_next_heading():
    readme = "# x\n## Writing a plugin\n`a`\n### sub\n`b`\n## Next\n`c`\n"
    assert plugin_section(readme) == "## Writing a plugin\n`a`\n### sub\n`b`"
