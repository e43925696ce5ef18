"""The format of one group-quantized chunk: grouping, symmetry, exact rows, rotation.

``ChunkFormat`` is what ``GroupQuantCodec.decode`` needs besides the shape; it travels as
the codec meta described in ``quant`` (``g``, ``a``, ``z``, ``t``, ``r``, ``x``, ``h``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlxcel_plugin.kv_codecs.base import CorruptChunk, meta_bool, meta_int
from mlxcel_plugin.kv_codecs.groups import DimGroups, TokenGroups, TokenSpan
from mlxcel_plugin.kv_codecs.rotation import MAX_BLOCK, is_rotation_block

# Bounds for a hostile meta; real layers are far below them.
MAX_TOKENS_PER_HEAD = 1 << 24
MAX_TOKEN_GROUP = 1 << 16


def effective_group(head_dim: int, group_size: int) -> int:
    """Groups never straddle rows; a head_dim the group does not divide uses whole rows."""
    return group_size if head_dim % group_size == 0 else head_dim


@dataclass(frozen=True)
class ChunkFormat:
    """How one chunk was quantized: everything ``decode`` needs besides the shape."""

    group: int
    along_tokens: bool
    asymmetric: bool
    span: TokenSpan | None  # None: no layout was known (no exact rows, no token groups)
    rotation: int = 0  # Hadamard block the rows were rotated in; 0: not rotated

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"g": self.group}
        if self.along_tokens:
            meta["a"] = "t"
        if self.asymmetric:
            meta["z"] = True
        if self.span is not None:
            meta.update(t=self.span.tokens, r=self.span.first, x=self.span.exact)
        if self.rotation:
            meta["h"] = self.rotation
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any], head_dim: int) -> ChunkFormat:
        along_tokens = _meta_axis(meta)
        span = _meta_span(meta) if along_tokens or "t" in meta else None
        if along_tokens and span is None:
            raise CorruptChunk("token groups need the chunk's token span")
        group_limit = MAX_TOKEN_GROUP if along_tokens else max(head_dim, 1)
        group = meta_int(meta, "g", 1, group_limit)
        if not along_tokens and head_dim % group:
            raise CorruptChunk(f"group {group} does not divide head_dim {head_dim}")
        asymmetric = meta_bool(meta, "z") if "z" in meta else False
        rotation = meta_int(meta, "h", 2, MAX_BLOCK) if "h" in meta else 0
        if rotation and not is_rotation_block(rotation, head_dim):
            raise CorruptChunk(f"rotation block {rotation} does not fit head_dim {head_dim}")
        return cls(group, along_tokens, asymmetric, span, rotation)

    def split(self, rows: int, head_dim: int) -> tuple[np.ndarray | None, DimGroups | TokenGroups]:
        """(mask of rows sent exact, or None; the groups of the other rows)."""
        exact = None
        positions = None
        if self.span is not None:
            positions = self.span.positions(rows)
            exact = positions < self.span.exact if self.span.exact else None
        quantized = rows - (int(exact.sum()) if exact is not None else 0)
        if not self.along_tokens:
            return exact, DimGroups(self.group, quantized, head_dim)
        if exact is not None:
            positions = positions[~exact]
        return exact, TokenGroups(self.group, positions, head_dim, self.span.exact)


def _meta_axis(meta: Mapping[str, Any]) -> bool:
    axis = meta.get("a") if isinstance(meta, Mapping) else None
    if axis not in (None, "t"):
        raise CorruptChunk(f"codec meta 'a' must be 't' or absent, got {axis!r:.20}")
    return axis == "t"


def _meta_span(meta: Mapping[str, Any]) -> TokenSpan:
    tokens = meta_int(meta, "t", 1, MAX_TOKENS_PER_HEAD)
    return TokenSpan(tokens, meta_int(meta, "r", 0, tokens - 1), meta_int(meta, "x", 0, tokens))


def pack_codes(codes: np.ndarray, bits: int, asymmetric: bool) -> bytes:
    """Codes as the body carries them: int8 as bytes (signed when symmetric), int4 two per
    byte, even element in the low nibble (``code + 8`` when symmetric)."""
    codes = codes.reshape(-1)
    if bits == 8:
        return codes.astype(np.uint8 if asymmetric else np.int8).tobytes()
    nibbles = (codes if asymmetric else codes + 8).astype(np.uint8)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(0 if asymmetric else 8))
    return (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()


def unpack_codes(raw: np.ndarray, count: int, bits: int, asymmetric: bool) -> np.ndarray:
    """The ``count`` codes of a body's code section, as integers."""
    if bits == 8:
        return raw.view(np.uint8 if asymmetric else np.int8)
    nibbles = np.empty(raw.size * 2, dtype=np.int8)
    nibbles[0::2] = raw & 0x0F
    nibbles[1::2] = raw >> 4
    return nibbles[:count] if asymmetric else nibbles[:count] - 8


def widen_scales(scales: np.ndarray) -> np.ndarray:
    """Stored scales as float32 (bfloat16 ones are the top half of a float32)."""
    if scales.dtype == np.dtype("<u2"):
        return (scales.astype("<u4") << 16).view("<f4")
    return scales.astype("<f4")
