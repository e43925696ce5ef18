"""Plugin manager: loads entry points and collects what hooks register.

``MLXCEL_PLUGINS`` (comma-separated entry-point names) is an allow-list;
``MLXCEL_DISABLE_PLUGINS`` removes names. Unknown names in config fail with
the list of registered ones.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import pluggy

from mlxcel_plugin import hookspecs
from mlxcel_plugin.errors import PluginError

KINDS = {
    "engine": "mlxcel_register_engines",
    "balancer": "mlxcel_register_balancers",
    "transfer_strategy": "mlxcel_register_transfer_strategies",
    "kv_codec": "mlxcel_register_kv_codecs",
    "role": "mlxcel_register_roles",
    "discovery": "mlxcel_register_discovery",
}


@dataclass
class PluginRegistry:
    """What every hook registered, by kind and name."""

    manager: pluggy.PluginManager
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)

    def get(self, kind: str, name: str) -> Any:
        registered = self.entries.get(kind, {})
        if name not in registered:
            known = ", ".join(sorted(registered)) or "none"
            raise PluginError(f"unknown {kind} {name!r}; registered: {known}")
        return registered[name]

    def names(self, kind: str) -> list[str]:
        return sorted(self.entries.get(kind, {}))


def _split_names(value: str | None) -> set[str] | None:
    if value is None or not value.strip():
        return None
    return {part.strip() for part in value.split(",") if part.strip()}


def _wanted_entry_points(env: Mapping[str, str]) -> Iterable[Any]:
    allowed = _split_names(env.get("MLXCEL_PLUGINS"))
    disabled = _split_names(env.get("MLXCEL_DISABLE_PLUGINS")) or set()
    for ep in entry_points(group=hookspecs.PROJECT_NAME):
        if allowed is not None and ep.name not in allowed:
            continue
        if ep.name in disabled:
            continue
        yield ep


def make_plugin_manager(
    env: Mapping[str, str] | None = None, extra_plugins: Iterable[Any] = ()
) -> pluggy.PluginManager:
    """Build the manager from entry points (filtered by env) plus ``extra_plugins``."""
    env = os.environ if env is None else env
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for ep in _wanted_entry_points(env):
        try:
            module = ep.load()
        except Exception as exc:  # a broken plugin must name itself, not crash obscurely
            raise PluginError(f"plugin {ep.name!r} ({ep.value}) failed to load: {exc}") from exc
        pm.register(module, name=ep.name)
    for plugin in extra_plugins:
        pm.register(plugin)
    # A misspelt hook implementation fails here, at startup.
    pm.check_pending()
    return pm


def collect(pm: pluggy.PluginManager) -> PluginRegistry:
    """Call every register hook and keep what was registered."""
    registry = PluginRegistry(manager=pm)
    for kind, hook_name in KINDS.items():
        registered: dict[str, Any] = {}

        def register(name: str, obj: Any, *, _kind: str = kind, _into=registered) -> None:
            if not isinstance(name, str) or not name:
                raise PluginError(f"{_kind} names must be non-empty strings, got {name!r}")
            if name in _into:
                raise PluginError(f"{_kind} {name!r} is registered twice")
            _into[name] = obj

        getattr(pm.hook, hook_name)(register=register)
        registry.entries[kind] = registered
    return registry


def load_plugins(
    env: Mapping[str, str] | None = None, extra_plugins: Iterable[Any] = ()
) -> PluginRegistry:
    return collect(make_plugin_manager(env, extra_plugins))
