"""The core's own plugin: KV transfer strategies and codecs, the prefill and decode
roles, and the ``fake`` test engine.

Registered through the same hooks as any third-party plugin (entry point ``core``).
"""

from __future__ import annotations

from mlxcel_plugin.hookspecs import Register, hookimpl
from mlxcel_plugin.kv_codecs import builtin_codecs
from mlxcel_plugin.transfer import FullTransfer, LayerParallelTransfer, StreamedTransfer


@hookimpl
def mlxcel_register_transfer_strategies(register: Register) -> None:
    for strategy in (FullTransfer, StreamedTransfer, LayerParallelTransfer):
        register(strategy.name, strategy)


@hookimpl
def mlxcel_register_kv_codecs(register: Register) -> None:
    for name, codec in builtin_codecs().items():
        register(name, codec)


def run_prefill(config, registry) -> None:
    # Imported on use: a router or hybrid process never loads the node modules.
    from mlxcel_plugin.nodes.roles import run_prefill as run

    run(config, registry)


def run_decode(config, registry) -> None:
    from mlxcel_plugin.nodes.roles import run_decode as run

    run(config, registry)


@hookimpl
def mlxcel_register_roles(register: Register) -> None:
    register("prefill", run_prefill)
    register("decode", run_decode)


def make_fake_engine(model_path, config):
    """A deterministic engine without MLX, for tests and the router-overhead benchmark."""
    from mlxcel_plugin.testing.fake_engine import make_fake_engine as make

    return make(model_path, config)


@hookimpl
def mlxcel_register_engines(register: Register) -> None:
    register("fake", make_fake_engine)
