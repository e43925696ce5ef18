"""Built-in codecs and name resolution (``int8+lz4`` composes registered codecs)."""

from __future__ import annotations

from collections.abc import Mapping

from mlxcel_plugin.kv_codecs.base import CodecError, CodecProfile, KVCodec, UnknownCodec
from mlxcel_plugin.kv_codecs.chain import MAX_STAGES, ChainCodec
from mlxcel_plugin.kv_codecs.lossless import IdentityCodec, Lz4Codec, ShuffleCodec
from mlxcel_plugin.kv_codecs.quant import GroupQuantCodec

MAX_CODEC_NAME = 128


# loadtests/bench_kv_codecs.py, 2 x86 cores: ratio 1.0 (noise fp16) .. 1.3 (smooth fp16)
# .. 2.0 (smooth bf16), encode 0.6-1.4 GB/s, decode 0.5-0.9 GB/s. Shuffle alone shrinks nothing.
SHUFFLE_LZ4_PROFILE = CodecProfile(ratio=1.15, encode_bytes_per_s=800e6, decode_bytes_per_s=600e6)


def builtin_codecs() -> dict[str, KVCodec]:
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


def resolve_codec(name: object, registered: Mapping[str, KVCodec]) -> KVCodec:
    """The codec for ``name``: registered as-is, or a ``+`` chain of registered ones."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_CODEC_NAME:
        raise UnknownCodec(f"codec name must be a short string, got {name!r}")
    if name in registered:
        return registered[name]
    parts = name.split("+")
    missing = [part for part in parts if part not in registered]
    if len(parts) == 1 or missing or len(parts) > MAX_STAGES:
        known = ", ".join(sorted(registered)) or "none"
        raise UnknownCodec(f"unknown codec {name!r}; registered: {known}")
    try:
        return ChainCodec([registered[part] for part in parts])
    except CodecError as exc:
        raise UnknownCodec(f"codec {name!r} cannot be composed: {exc.message}") from exc
