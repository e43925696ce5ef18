"""The core's own plugin: KV transfer strategies and codecs, the prefill and decode
roles, and the ``fake`` test engine.

Registered through the same hooks as any third-party plugin (entry point ``core``);
this is the only place the built-in strategies and codecs are listed.
"""

from __future__ import annotations

from mlxcel_plugin.hookspecs import Register, hookimpl
from mlxcel_plugin.kv_codecs import (
    ChainCodec,
    CodecProfile,
    GroupQuantCodec,
    IdentityCodec,
    KVCodec,
    Lz4Codec,
    ShuffleCodec,
)
from mlxcel_plugin.transfer import FullTransfer, LayerParallelTransfer, StreamedTransfer

TRANSFER_STRATEGIES = (FullTransfer, StreamedTransfer, LayerParallelTransfer)

# loadtests/bench_kv_codecs.py, 2 x86 cores: ratio 1.0 (noise fp16) .. 1.3 (smooth fp16)
# .. 2.0 (smooth bf16), encode 0.6-1.4 GB/s, decode 0.5-0.9 GB/s. Shuffle alone shrinks nothing.
SHUFFLE_LZ4_PROFILE = CodecProfile(ratio=1.15, encode_bytes_per_s=800e6, decode_bytes_per_s=600e6)


def builtin_codecs() -> dict[str, KVCodec]:
    """The codecs this plugin registers, by name (fresh instances).

    For code that runs without a plugin manager (contract suites, benchmarks);
    a node gets them from its ``PluginRegistry`` like any plugin's.
    """
    shuffle, lz4 = ShuffleCodec(), Lz4Codec()
    codecs: list[KVCodec] = [
        IdentityCodec(),
        lz4,
        shuffle,
        ChainCodec([shuffle, lz4], SHUFFLE_LZ4_PROFILE),
        GroupQuantCodec(8),
        GroupQuantCodec(4),
    ]
    return {codec.name: codec for codec in codecs}


@hookimpl
def mlxcel_register_transfer_strategies(register: Register) -> None:
    for strategy in TRANSFER_STRATEGIES:
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
    from mlxcel_plugin.testing.fake_autoregressive import make_fake_engine as make

    return make(model_path, config)


@hookimpl
def mlxcel_register_engines(register: Register) -> None:
    register("fake", make_fake_engine)
