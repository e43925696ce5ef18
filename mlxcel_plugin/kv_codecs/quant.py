"""Group-wise symmetric quantization (int8, int4) along head_dim.

Each group of ``group_size`` consecutive values of one row (one head, one
token) shares a float32 scale ``max|x| / qmax``. Body layout: all scales
(``<f4``), then the codes (int8; or int4 as ``code + 8`` packed two per byte,
even element in the low nibble). Lossy: never chosen by the adaptive selector
unless the config allows it — exact parity with a single node needs lossless.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from mlxcel_plugin.kv_codecs.base import (
    Buffer,
    CodecError,
    CodecProfile,
    CorruptChunk,
    meta_int,
    storage_dtype,
)

_SCALE = np.dtype("<f4")


def to_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        # bf16 is the top half of an f32: shift the bits back into place.
        return (array.astype("<u4") << 16).view("<f4")
    if dtype in ("float16", "float32"):
        return array.astype("<f4")
    raise CodecError(f"quantization needs a float tensor, got {dtype!r}")


def from_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        bits = values.astype("<f4").view("<u4")
        # Round to nearest even on the 16 dropped bits, as MLX's own cast does.
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
        return rounded.astype("<u2")
    return values.astype(storage_dtype(dtype))


def effective_group(head_dim: int, group_size: int) -> int:
    """Groups never straddle rows; a head_dim the group does not divide uses whole rows."""
    return group_size if head_dim % group_size == 0 else head_dim


class GroupQuantCodec:
    def __init__(self, bits: int, group_size: int = 64):
        if bits not in (4, 8):
            raise CodecError(f"bits must be 4 or 8, got {bits}")
        self.bits = bits
        self.group_size = group_size
        self.qmax = (1 << (bits - 1)) - 1  # symmetric: 127 or 7
        self.name = f"int{bits}"
        self.lossless = False
        # fp16 input, head_dim 128: (64 codes + 4-byte scale) per 128 raw bytes.
        code_bytes = group_size * bits // 8
        self.profile = CodecProfile(
            ratio=(2 * group_size) / (code_bytes + _SCALE.itemsize),
            # bench_kv_codecs.py on fp16, 2 x86 cores (int4's unpacking is the slow part).
            encode_bytes_per_s=600e6,
            decode_bytes_per_s=700e6 if bits == 8 else 380e6,
            # Half a step of rounding, plus the output dtype's own rounding.
            relative_error=0.5 / self.qmax + 2.0**-8,
        )

    def encode(self, array: np.ndarray, dtype: str) -> tuple[Buffer, dict[str, Any]]:
        group = effective_group(array.shape[-1], self.group_size)
        groups = to_float32(array, dtype).reshape(-1, group)
        scales = (np.abs(groups).max(axis=1) / self.qmax).astype(_SCALE)
        if not np.isfinite(scales).all():
            raise CodecError(f"{self.name}: tensor holds inf/nan, cannot quantize")
        inverse = np.divide(1.0, scales, out=np.zeros_like(scales), where=scales > 0)
        codes = np.clip(np.rint(groups * inverse[:, None]), -self.qmax, self.qmax)
        body = scales.tobytes() + self._pack(codes.astype(np.int8).reshape(-1))
        return body, {"g": group}

    def decode(
        self, data: Buffer, meta: Mapping[str, Any], shape: tuple[int, ...], dtype: str
    ) -> np.ndarray:
        count = math.prod(shape)
        group = meta_int(meta, "g", 1, max(shape[-1], 1))
        if count % group or shape[-1] % group:
            raise CorruptChunk(f"{self.name}: group {group} does not divide shape {shape}")
        n_groups = count // group
        code_bytes = count if self.bits == 8 else (count + 1) // 2
        want = n_groups * _SCALE.itemsize + code_bytes
        if len(data) != want:
            raise CorruptChunk(f"{self.name}: body is {len(data)} bytes, expected {want}")
        split = n_groups * _SCALE.itemsize
        scales = np.frombuffer(data, dtype=_SCALE, count=n_groups)
        self._check_scales(scales, dtype)
        codes = self._unpack(np.frombuffer(data, dtype=np.uint8, offset=split), count)
        values = codes.reshape(n_groups, group).astype("<f4") * scales[:, None]
        return from_float32(values, dtype).reshape(shape)

    def _check_scales(self, scales: np.ndarray, dtype: str) -> None:
        """A scale no encoder of ``dtype`` data can produce means a corrupt body."""
        limit = 65504.0 if dtype == "float16" else float(np.finfo(np.float32).max)
        with np.errstate(over="ignore", invalid="ignore"):
            largest = scales.astype(np.float64).max(initial=0.0) * self.qmax
            # The slack absorbs float32 rounding of max|x| / qmax at the very top of the range.
            ok = bool(np.all(scales >= 0)) and largest <= limit * (1 + 2.0**-20)
        if not ok:
            raise CorruptChunk(f"{self.name}: scales out of range for {dtype}")

    def _pack(self, codes: np.ndarray) -> bytes:
        if self.bits == 8:
            return codes.tobytes()
        nibbles = (codes + 8).astype(np.uint8)
        if nibbles.size % 2:
            nibbles = np.append(nibbles, np.uint8(8))
        return (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()

    def _unpack(self, raw: np.ndarray, count: int) -> np.ndarray:
        if self.bits == 8:
            return raw.view(np.int8)
        nibbles = np.empty(raw.size * 2, dtype=np.int8)
        nibbles[0::2] = raw & 0x0F
        nibbles[1::2] = raw >> 4
        return nibbles[:count] - 8
