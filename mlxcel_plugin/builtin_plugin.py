"""The core's own plugin: built-in KV transfer strategies and codecs.

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
