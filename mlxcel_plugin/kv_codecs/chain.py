"""Composition: ``int8+lz4`` runs int8, then LZ4 over int8's bytes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mlxcel_plugin.kv_codecs.base import (
    Buffer,
    ChunkLayout,
    CodecError,
    CodecProfile,
    CorruptChunk,
    KVCodec,
    expected_nbytes,
)

# A hostile meta could declare a huge intermediate size; no real stage expands
# a chunk past this factor of its decoded size.
MAX_STAGE_EXPANSION = 4
MAX_STAGES = 4


def chain_profile(stages: Sequence[KVCodec]) -> CodecProfile:
    ratio = math.prod(stage.profile.ratio for stage in stages)
    return CodecProfile(
        ratio=ratio,
        encode_bytes_per_s=1.0 / sum(1.0 / s.profile.encode_bytes_per_s for s in stages),
        decode_bytes_per_s=1.0 / sum(1.0 / s.profile.decode_bytes_per_s for s in stages),
        relative_error=max(stage.profile.relative_error for stage in stages),
    )


class ChainCodec:
    """Stages applied left to right on encode, right to left on decode.

    Only the first stage sees the tensor; later stages see bytes (dtype
    ``uint8``), so a lossy stage may only come first.
    """

    def __init__(self, stages: Sequence[KVCodec], profile: CodecProfile | None = None):
        if not 2 <= len(stages) <= MAX_STAGES:
            raise CodecError(f"a chained codec needs 2..{MAX_STAGES} stages")
        if any(not stage.lossless for stage in stages[1:]):
            raise CodecError("only the first stage of a chained codec may be lossy")
        self.stages = tuple(stages)
        self.name = "+".join(stage.name for stage in stages)
        self.lossless = all(stage.lossless for stage in stages)
        # Stages interact (shuffle does nothing alone but helps LZ4): a measured
        # profile beats the product of the parts when one is known.
        self.profile = profile or chain_profile(stages)

    def encode(
        self, array: np.ndarray, dtype: str, layout: ChunkLayout | None = None
    ) -> tuple[Buffer, dict[str, Any]]:
        # Only the first stage sees the tensor, so only it gets the layout.
        data, first_meta = self.stages[0].encode(array, dtype, layout)
        metas, sizes = [first_meta], []
        for stage in self.stages[1:]:
            sizes.append(len(data))
            data, meta = stage.encode(np.frombuffer(data, dtype=np.uint8), "uint8")
            metas.append(meta)
        return data, {"s": metas, "n": sizes}

    def decode(
        self, data: Buffer, meta: Mapping[str, Any], shape: tuple[int, ...], dtype: str
    ) -> np.ndarray:
        metas, sizes = self._parse_meta(meta, expected_nbytes(shape, dtype))
        for stage, stage_meta, size in zip(
            reversed(self.stages[1:]), reversed(metas[1:]), reversed(sizes), strict=True
        ):
            data = stage.decode(data, stage_meta, (size,), "uint8").data.cast("B")
        return self.stages[0].decode(data, metas[0], shape, dtype)

    def _parse_meta(self, meta: Mapping[str, Any], decoded_nbytes: int) -> tuple[list, list]:
        metas = meta.get("s") if isinstance(meta, Mapping) else None
        sizes = meta.get("n") if isinstance(meta, Mapping) else None
        stages = len(self.stages)
        if not isinstance(metas, list) or not isinstance(sizes, list):
            raise CorruptChunk(f"{self.name}: meta needs lists 's' and 'n'")
        if len(metas) != stages or len(sizes) != stages - 1:
            raise CorruptChunk(f"{self.name}: meta does not match {stages} stages")
        limit = MAX_STAGE_EXPANSION * decoded_nbytes + 1024
        for size in sizes:
            if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= limit:
                raise CorruptChunk(f"{self.name}: bad intermediate size {size!r}")
        if not all(isinstance(m, Mapping) for m in metas):
            raise CorruptChunk(f"{self.name}: stage meta must be maps")
        return metas, sizes
