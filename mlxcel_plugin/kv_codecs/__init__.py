"""KV codecs: compression and quantization of K/V chunks (see ``base`` for the contract)."""

from mlxcel_plugin.kv_codecs.base import (
    TENSOR_DTYPES,
    WIRE_DTYPES,
    Buffer,
    ChunkLayout,
    CodecError,
    CodecProfile,
    CorruptChunk,
    KVCodec,
    UnknownCodec,
    storage_dtype,
)
from mlxcel_plugin.kv_codecs.chain import ChainCodec
from mlxcel_plugin.kv_codecs.floats import from_float32, to_float32
from mlxcel_plugin.kv_codecs.lossless import IdentityCodec, Lz4Codec, ShuffleCodec
from mlxcel_plugin.kv_codecs.quant import GroupQuantCodec
from mlxcel_plugin.kv_codecs.resolve import resolve_codec

__all__ = [
    "TENSOR_DTYPES",
    "WIRE_DTYPES",
    "Buffer",
    "ChainCodec",
    "ChunkLayout",
    "CodecError",
    "CodecProfile",
    "CorruptChunk",
    "GroupQuantCodec",
    "IdentityCodec",
    "KVCodec",
    "Lz4Codec",
    "ShuffleCodec",
    "UnknownCodec",
    "from_float32",
    "resolve_codec",
    "storage_dtype",
    "to_float32",
]
