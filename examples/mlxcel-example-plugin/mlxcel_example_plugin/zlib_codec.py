"""zlib over each K/V chunk, kept only where it shrinks the chunk.

Lossless, standard library only. KV bytes barely compress (≈1.06× on fp16 and
fp32, ≈1.2× on bf16; ≈1.1–2.5× after the built-in ``shuffle`` stage, so try
``shuffle+zlib``), and zlib encodes at ~50 MB/s per core: it pays only on
links slower than that. The profile says so, and the adaptive selector plans
with it.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
from mlxcel_plugin.kv_codecs.base import (
    Buffer,
    ChunkLayout,
    CodecProfile,
    CorruptChunk,
    expected_nbytes,
    frombuffer_checked,
    meta_bool,
    raw_view,
)

# Level 1: on KV noise higher levels buy <1% ratio for 2x the encode time.
LEVEL = 1


class ZlibCodec:
    """``meta["c"]`` says whether the chunk body is a zlib stream or the raw bytes."""

    name = "zlib"
    lossless = True
    # Measured on synthetic fp16/bf16/fp32 KV (mlxcel_plugin.testing.caches), 2 x86 cores.
    profile = CodecProfile(ratio=1.06, encode_bytes_per_s=50e6, decode_bytes_per_s=250e6)

    def encode(
        self, array: np.ndarray, dtype: str, layout: ChunkLayout | None = None
    ) -> tuple[Buffer, dict[str, Any]]:
        raw = raw_view(array)
        packed = zlib.compress(raw, LEVEL)
        if len(packed) < len(raw):
            return packed, {"c": True}
        # Incompressible chunks travel raw: the receiver then copies nothing.
        return raw, {"c": False}

    def decode(
        self, data: Buffer, meta: Mapping[str, Any], shape: tuple[int, ...], dtype: str
    ) -> np.ndarray:
        if not meta_bool(meta, "c"):
            return frombuffer_checked(data, shape, dtype)
        return frombuffer_checked(_inflate(data, expected_nbytes(shape, dtype)), shape, dtype)


def _inflate(data: Buffer, want: int) -> bytes:
    """Decompress exactly one zlib stream of ``want`` bytes, never allocating more."""
    inflater = zlib.decompressobj()
    try:
        # max_length bounds the allocation to what the handoff header declared
        # (0 would mean "unbounded" to zlib, hence at least 1).
        raw = inflater.decompress(data, max(want, 1))
    except zlib.error as exc:
        raise CorruptChunk(f"zlib chunk does not decompress: {exc}") from exc
    # A truncated stream never reaches eof; trailing bytes land in unused_data.
    if not inflater.eof or inflater.unconsumed_tail or inflater.unused_data:
        raise CorruptChunk(f"zlib chunk is not one stream of {want} bytes")
    return raw
