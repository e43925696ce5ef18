import pytest

from mlxcel_plugin.errors import PluginError
from mlxcel_plugin.hookspecs import hookimpl
from mlxcel_plugin.plugins import KINDS, load_plugins, make_plugin_manager


class ExtraPlugin:
    @hookimpl
    def mlxcel_register_balancers(self, register):
        register("test-only", object)


class DuplicatePlugin:
    @hookimpl
    def mlxcel_register_balancers(self, register):
        register("dup", object)
        register("dup", object)


class MisspeltPlugin:
    @hookimpl
    def mlxcel_register_balancer(self, register):  # missing "s": must fail at startup
        register("x", object)


def test_extra_plugin_registers_by_name():
    registry = load_plugins(env={"MLXCEL_PLUGINS": "none-at-all"}, extra_plugins=[ExtraPlugin()])
    assert registry.get("balancer", "test-only") is object
    assert registry.names("balancer") == ["test-only"]


def test_unknown_name_lists_registered_ones():
    registry = load_plugins(env={"MLXCEL_PLUGINS": "none-at-all"}, extra_plugins=[ExtraPlugin()])
    with pytest.raises(PluginError, match=r"unknown balancer 'nope'; registered: test-only"):
        registry.get("balancer", "nope")


def test_duplicate_names_are_refused():
    with pytest.raises(PluginError, match="registered twice"):
        load_plugins(env={"MLXCEL_PLUGINS": "none-at-all"}, extra_plugins=[DuplicatePlugin()])


def test_misspelt_hook_fails_at_startup():
    with pytest.raises(Exception, match="unknown hook"):
        make_plugin_manager(env={"MLXCEL_PLUGINS": "none-at-all"}, extra_plugins=[MisspeltPlugin()])


def test_builtins_load_through_entry_points():
    registry = load_plugins(env={})
    assert set(registry.entries) == set(KINDS)
    assert "mlx" in registry.names("engine")
    assert {"hybrid", "prefill", "decode", "router"} <= set(registry.names("role"))


def test_disable_and_allow_lists():
    registry = load_plugins(env={"MLXCEL_DISABLE_PLUGINS": "mlx_engines"})
    assert "mlx" not in registry.names("engine")
    registry = load_plugins(env={"MLXCEL_PLUGINS": "mlx_engines"})
    assert registry.names("engine") == ["mlx", "synthetic-kv"]
    assert registry.names("balancer") == []


@pytest.mark.parametrize(
    "entry_point, expected",
    [
        ("core", {
            "transfer_strategy": ["full", "layer-parallel", "streamed"],
            "kv_codec": ["int4", "int8", "lz4", "none", "shuffle", "shuffle+lz4"],
            "role": ["decode", "prefill"],
            "engine": ["fake"],
            "balancer": [], "discovery": [],
        }),
        ("router", {
            "balancer": ["least-loaded", "memory-aware", "prefix-aware", "prompt-length-aware",
                         "round-robin"],
            "role": ["hybrid", "router"],
            "transfer_strategy": [], "kv_codec": [], "engine": [],
            "discovery": ["dns", "file", "kubernetes", "mdns", "static"],
        }),
        ("mlx_engines", {
            "engine": ["mlx", "synthetic-kv"], "balancer": [], "role": [],
            "transfer_strategy": [], "kv_codec": [],
            "discovery": [],
        }),
    ],
)  # fmt: skip
def test_each_builtin_plugin_registers_its_kinds_through_the_hooks(entry_point, expected):
    registry = load_plugins(env={"MLXCEL_PLUGINS": entry_point})
    assert {kind: registry.names(kind) for kind in KINDS} == expected
