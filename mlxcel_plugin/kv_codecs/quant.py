"""Group-wise symmetric quantization (int8, int4) along head_dim.

Each group of ``group_size`` consecutive values of one row (one head, one
token) shares a scale ``max|x| / qmax``. Body layout: all scales, then the
codes (int8; or int4 as ``code + 8`` packed two per byte, even element in the
low nibble). Lossy: never chosen by the adaptive selector unless the config
allows it — exact parity with a single node needs lossless.

Scales are as wide as the data needs (``meta["s"]``): float16 data gets
``<f2`` scales and bfloat16 data bfloat16 ones (raw ``<u2`` bits), rounded up
so no code clips — 4 bytes per 64-value group were 3% of an int8 body. A
float16 chunk whose scales do not fit float16 (tiny or top-of-range groups)
keeps ``<f4`` scales, as float32 data does; a body without ``s`` has ``<f4``.
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
SCALE_F4, SCALE_F2, SCALE_BF16 = "f4", "f2", "bf16"
_SCALE_DTYPES = {SCALE_F4: _SCALE, SCALE_F2: np.dtype("<f2"), SCALE_BF16: np.dtype("<u2")}
_F16_MIN_NORMAL = 2.0**-14  # below it a float16 scale loses precision
_F16_MAX = 65504.0


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
        # fp16 input, head_dim 128: (64 codes + 2-byte scale) per 128 raw bytes.
        code_bytes = group_size * bits // 8
        self.profile = CodecProfile(
            ratio=(2 * group_size) / (code_bytes + 2),
            # bench_kv_codecs.py on fp16, 2 x86 cores (int4's unpacking is the slow part).
            encode_bytes_per_s=600e6,
            decode_bytes_per_s=700e6 if bits == 8 else 380e6,
            # Half a step of rounding, plus the output dtype's own rounding (a
            # rounded-up half-precision scale widens the step by at most 2**-7).
            relative_error=0.5 / self.qmax + 2.0**-8,
        )

    def encode(self, array: np.ndarray, dtype: str) -> tuple[Buffer, dict[str, Any]]:
        group = effective_group(array.shape[-1], self.group_size)
        groups = to_float32(array, dtype).reshape(-1, group)
        scales = (np.abs(groups).max(axis=1) / self.qmax).astype(_SCALE)
        if not np.isfinite(scales).all():
            raise CodecError(f"{self.name}: tensor holds inf/nan, cannot quantize")
        kind, stored, scales = self._narrow_scales(scales, dtype)
        inverse = np.divide(1.0, scales, out=np.zeros_like(scales), where=scales > 0)
        codes = np.clip(np.rint(groups * inverse[:, None]), -self.qmax, self.qmax)
        body = stored.tobytes() + self._pack(codes.astype(np.int8).reshape(-1))
        meta: dict[str, Any] = {"g": group}
        if kind != SCALE_F4:
            meta["s"] = kind
        return body, meta

    def _narrow_scales(self, scales: np.ndarray, dtype: str) -> tuple[str, np.ndarray, np.ndarray]:
        """(kind, scales as stored, the same as float32): half width where exact enough."""
        if dtype == "bfloat16":
            bits = scales.view("<u4")
            # Round up (never down: a smaller scale would clip the group's max).
            up = ((bits.astype(np.uint64) + 0xFFFF) >> 16).astype("<u2")
            widened = (up.astype("<u4") << 16).view("<f4")
            if np.isfinite(widened * self.qmax).all():
                return SCALE_BF16, up, widened
        elif dtype == "float16":
            half = scales.astype("<f2")
            half = np.where(half.astype("<f4") < scales, np.nextafter(half, np.inf), half)
            widened = half.astype("<f4")
            usable = (widened == 0) | (widened >= _F16_MIN_NORMAL)
            if usable.all() and (widened * self.qmax <= _F16_MAX).all():
                return SCALE_F2, half.astype("<f2"), widened
        return SCALE_F4, scales, scales

    def decode(
        self, data: Buffer, meta: Mapping[str, Any], shape: tuple[int, ...], dtype: str
    ) -> np.ndarray:
        count = math.prod(shape)
        group = meta_int(meta, "g", 1, max(shape[-1], 1))
        if count % group or shape[-1] % group:
            raise CorruptChunk(f"{self.name}: group {group} does not divide shape {shape}")
        n_groups = count // group
        scale_dtype = self._scale_dtype(meta, dtype)
        code_bytes = count if self.bits == 8 else (count + 1) // 2
        split = n_groups * scale_dtype.itemsize
        want = split + code_bytes
        if len(data) != want:
            raise CorruptChunk(f"{self.name}: body is {len(data)} bytes, expected {want}")
        scales = _widen(np.frombuffer(data, dtype=scale_dtype, count=n_groups))
        self._check_scales(scales, dtype)
        codes = self._unpack(np.frombuffer(data, dtype=np.uint8, offset=split), count)
        values = codes.reshape(n_groups, group).astype("<f4") * scales[:, None]
        return from_float32(values, dtype).reshape(shape)

    def _scale_dtype(self, meta: Mapping[str, Any], dtype: str) -> np.dtype:
        kind = meta.get("s", SCALE_F4) if isinstance(meta, Mapping) else SCALE_F4
        allowed = {SCALE_F4, SCALE_F2 if dtype == "float16" else SCALE_BF16}
        if kind not in allowed or (kind == SCALE_BF16 and dtype != "bfloat16"):
            raise CorruptChunk(f"{self.name}: scale kind {kind!r:.20} for {dtype} data")
        return _SCALE_DTYPES[kind]

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


def _widen(scales: np.ndarray) -> np.ndarray:
    """Stored scales as float32 (bfloat16 ones are the top half of a float32)."""
    if scales.dtype == np.dtype("<u2"):
        return (scales.astype("<u4") << 16).view("<f4")
    return scales.astype("<f4")
