"""ZlibCodec: the shared codec contract, alone and chained after ``shuffle``."""

from __future__ import annotations

import numpy as np
import pytest
from mlxcel_plugin.builtin_plugin import builtin_codecs
from mlxcel_plugin.kv_codecs import CorruptChunk, resolve_codec
from mlxcel_plugin.testing.codec_contract import CodecContract

from mlxcel_example_plugin import ZlibCodec


class TestZlibCodec(CodecContract):
    @pytest.fixture
    def codec(self):
        return ZlibCodec()


class TestShuffleThenZlib(CodecContract):
    """Names compose: ``shuffle+zlib`` is built from the core's shuffle and this codec."""

    @pytest.fixture
    def codec(self):
        return resolve_codec("shuffle+zlib", {**builtin_codecs(), "zlib": ZlibCodec()})


def test_compressible_chunk_is_kept_compressed():
    array = np.zeros((64, 64), dtype="<f2")
    body, meta = ZlibCodec().encode(array, "float16")
    assert meta == {"c": True} and len(body) < array.nbytes


def test_incompressible_chunk_travels_raw():
    noise = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    body, meta = ZlibCodec().encode(noise, "uint8")
    assert meta == {"c": False} and bytes(body) == noise.tobytes()


def test_a_stream_longer_than_declared_is_refused_without_inflating_it():
    bomb = np.zeros(1 << 20, dtype=np.uint8)
    body, meta = ZlibCodec().encode(bomb, "uint8")
    with pytest.raises(CorruptChunk):
        ZlibCodec().decode(body, meta, (16,), "uint8")


def test_empty_shape_with_a_compressed_body_is_refused():
    body, meta = ZlibCodec().encode(np.zeros(4096, dtype=np.uint8), "uint8")
    with pytest.raises(CorruptChunk):
        ZlibCodec().decode(body, meta, (0,), "uint8")
