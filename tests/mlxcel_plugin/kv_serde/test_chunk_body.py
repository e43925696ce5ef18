"""A coded chunk lands in its rows: through ``decode_into`` where the codec has it, else decode."""

from __future__ import annotations

import numpy as np
import pytest

from mlxcel_plugin.kv_codecs import ChunkLayout, CorruptChunk, GroupQuantCodec
from mlxcel_plugin.kv_serde.chunk_body import decode_chunk_into
from mlxcel_plugin.kv_serde.layer_spec import ArraySpec
from mlxcel_plugin.kv_serde.messages import ChunkHeader, LayerDescriptor

HEADS, TOKENS, HEAD_DIM = 3, 2048, 64
SPEC = ArraySpec("k", (1, HEADS, 0, HEAD_DIM), "float32", grow_axis=2, coded=True)


class DecodeOnly:
    """A plugin codec with only the protocol's ``decode``: wraps int8."""

    def __init__(self):
        self.inner = GroupQuantCodec(8)
        self.name, self.lossless, self.profile = "int8-plain", False, self.inner.profile

    def encode(self, array, dtype, layout=None):
        return self.inner.encode(array, dtype, layout)

    def decode(self, data, meta, shape, dtype):
        return self.inner.decode(data, meta, shape, dtype)


class IntoOnly(GroupQuantCodec):
    """int8 whose ``decode`` the receiver must not need."""

    def decode(self, data, meta, shape, dtype):
        raise AssertionError("the receiver decoded into a fresh array")


def chunk_of(rows: np.ndarray, row: int, codec) -> tuple[ChunkHeader, bytes]:
    body, meta = codec.encode(rows, "float32", ChunkLayout("k", TOKENS, row))
    header = ChunkHeader("h-1", 1, 0, "k", row, rows.shape[0], len(body),
                         LayerDescriptor(TOKENS, TOKENS, {}), meta)
    return header, bytes(body)


@pytest.mark.parametrize("codec", [IntoOnly(8), DecodeOnly()], ids=["into", "decode"])
def test_a_chunk_lands_in_its_rows_only_and_decodes_alike_either_way(codec):
    values = np.random.default_rng(0).standard_normal((HEADS * TOKENS, HEAD_DIM)).astype("<f4")
    tensor = np.full((1, HEADS, TOKENS, HEAD_DIM), -7.0, dtype="<f4")
    header, body = chunk_of(values[1000:5000], 1000, codec)
    decode_chunk_into(codec, header, body, tensor, SPEC)
    rows = tensor.reshape(-1, HEAD_DIM)
    want = GroupQuantCodec(8).decode(body, header.codec_meta, (4000, HEAD_DIM), "float32")
    assert np.array_equal(rows[1000:5000], want)
    assert np.all(rows[:1000] == -7.0) and np.all(rows[5000:] == -7.0)  # nothing else touched


def test_a_corrupt_body_fails_through_decode_into_with_a_named_error():
    codec = GroupQuantCodec(8)
    values = np.random.default_rng(1).standard_normal((TOKENS, HEAD_DIM)).astype("<f4")
    header, body = chunk_of(values, 0, codec)
    tensor = np.zeros((1, HEADS, TOKENS, HEAD_DIM), dtype="<f4")
    with pytest.raises(CorruptChunk, match="body is"):
        decode_chunk_into(codec, header, body[:-5], tensor, SPEC)
