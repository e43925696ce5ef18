"""The hooks register what they should, checked through the core's own plugin manager."""

from __future__ import annotations

from mlxcel_plugin.kv_codecs import resolve_codec
from mlxcel_plugin.plugins import load_plugins

from mlxcel_example_plugin import PowerOfTwoBalancer, ZlibCodec, plugin


def registry_with_this_plugin():
    # MLXCEL_PLUGINS=core keeps an installed copy of this plugin out, so nothing registers twice.
    return load_plugins(env={"MLXCEL_PLUGINS": "core"}, extra_plugins=[plugin])


def test_registers_the_balancer_factory():
    factory = registry_with_this_plugin().get("balancer", "power-of-two")
    assert factory is PowerOfTwoBalancer
    assert factory(0).name == "power-of-two"


def test_registers_the_codec_and_it_composes_with_core_codecs():
    registry = registry_with_this_plugin()
    assert isinstance(registry.get("kv_codec", "zlib"), ZlibCodec)
    assert resolve_codec("shuffle+zlib", registry.entries["kv_codec"]).name == "shuffle+zlib"
