"""Float tensors as float32 and back, in the storage each KV dtype travels in.

bfloat16 travels as its uint16 bits (numpy has no bfloat16); float16 and float32 as
themselves. Quantization works in float32 and stores minimums and outputs back in the
tensor's own dtype.
"""

from __future__ import annotations

import numpy as np

from mlxcel_plugin.kv_codecs.base import CodecError, storage_dtype
from mlxcel_plugin.kv_codecs.scratch import scratch

F16_MAX = 65504.0
BF16_MAX = float(np.uint32(0x7F7F0000).view(np.float32))
F32_MAX = float(np.finfo(np.float32).max)
# float16's exponent bias is 15, float32's 127: moving the bits is scaling by 2**112.
_F16_TO_F32 = np.float32(2.0**112)
_F32_TO_F16 = np.float32(2.0**-112)
_F16_EXPONENT_BITS = 0x7C00  # all ones: inf or nan
_F16_MIN_NORMAL_AS_F32 = 0x38800000  # 2**-14, float32 bits


def to_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        # bf16 is the top half of an f32: widen, then shift the bits into place (in place).
        bits = np.empty(array.shape, dtype="<u4")
        np.copyto(bits, array, casting="unsafe")
        np.left_shift(bits, 16, out=bits)
        return bits.view("<f4")
    if dtype == "float16":
        return float16_to_float32(array)
    if dtype == "float32":
        return array.astype("<f4", copy=False)  # callers never write into it
    raise CodecError(f"quantization needs a float tensor, got {dtype!r}")


def from_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        bits = values.astype("<f4").view("<u4")
        # Round to nearest even on the 16 dropped bits, as MLX's own cast does.
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
        return rounded.astype("<u2")
    return values.astype(storage_dtype(dtype), copy=False)


def float16_to_float32(array: np.ndarray) -> np.ndarray:
    """float16 values as float32, exactly as NumPy casts them but ~3x faster (measured 0.5
    against 1.6 ns per value): exponent and mantissa bits moved under float32's are the
    value times 2**-112 (subnormals included). With an inf or nan: NumPy's cast."""
    wide = np.empty(array.shape, dtype="<u4")
    np.copyto(wide, array.view("<u2"), casting="unsafe")
    magnitude = np.bitwise_and(wide, np.uint32(0x7FFF))
    if magnitude.size and magnitude.max() >= _F16_EXPONENT_BITS:
        return array.astype("<f4")
    np.left_shift(magnitude, 13, out=magnitude)
    values = magnitude.view("<f4")
    np.multiply(values, _F16_TO_F32, out=values)
    np.bitwise_and(wide, np.uint32(0x8000), out=wide)
    np.left_shift(wide, 16, out=wide)
    np.bitwise_or(magnitude, wide, out=magnitude)
    return values


def buffer(name: str, like: np.ndarray) -> np.ndarray:
    return scratch(name, like.shape, like.dtype)


def float16_bits(values: np.ndarray) -> np.ndarray:
    """``values`` (float32, finite, |x| <= F16_MAX; overwritten) as float16 bits in uint32,
    rounded to nearest even exactly as NumPy's cast, ~2.5x faster. Values below float16's
    smallest normal (scaling them would round twice) round on the subnormal grid apart."""
    bits = values.view("<u4")
    scratch = np.bitwise_and(bits, np.uint32(0x7FFFFFFF), out=buffer("f16.work", bits))
    np.subtract(scratch, np.uint32(1), out=scratch)  # zero wraps to the top
    tiny = np.flatnonzero(scratch < _F16_MIN_NORMAL_AS_F32 - 1)
    subnormal = np.rint(np.abs(values.reshape(-1)[tiny]) * np.float32(2.0**24))
    sign = np.right_shift(bits, 16, out=buffer("f16.sign", bits))
    np.bitwise_and(sign, np.uint32(0x8000), out=sign)
    np.bitwise_and(bits, np.uint32(0x7FFFFFFF), out=bits)
    np.multiply(values, _F32_TO_F16, out=values)  # exact where the result stays normal
    np.right_shift(bits, 13, out=scratch)
    np.bitwise_and(scratch, np.uint32(1), out=scratch)
    np.add(bits, scratch, out=bits)
    np.add(bits, np.uint32(0x0FFF), out=bits)  # ties to even on the 13 dropped bits
    np.right_shift(bits, 13, out=bits)
    np.bitwise_or(bits, sign, out=bits)
    flat = bits.reshape(-1)
    flat[tiny] = subnormal.astype(np.uint32) | sign.reshape(-1)[tiny]  # k x 2**-24
    return bits


def rounded_for_storage(values: np.ndarray, dtype: str) -> np.ndarray:
    """``values`` (float32, overwritten) rounded to nearest in ``dtype``: either the
    storage's bits (an unsigned array: copy it into the storage's bits) or float32 values
    (copy them with ``casting="unsafe"``). Finite values past ``dtype``'s largest must be
    clipped first.

    bfloat16: ties away from zero, one integer pass where ``from_float32``'s ties-to-even
    takes five: the bits are each element's high half after the add, returned as a
    strided uint16 view (no shift pass: the copy into the storage takes them; ~13% less
    time for the rounding and that copy, measured). float16: ``float16_bits`` (ties to
    even)."""
    if dtype == "float16":
        return float16_bits(values)
    if dtype != "bfloat16":
        return values
    bits = values.view("<u4")
    np.add(bits, np.uint32(0x8000), out=bits)
    return bits.view("<u2")[..., 1::2]  # little-endian: the high half of each


def round_down(values: np.ndarray, dtype: str) -> np.ndarray:
    """``values`` (float32) in ``dtype``'s storage, each the largest one not above it."""
    stored = from_float32(values, dtype)
    if dtype == "float32":
        return stored
    above = to_float32(stored, dtype) > values
    if dtype == "float16":
        return np.where(above, np.nextafter(stored, np.float16(-np.inf)), stored)
    # bfloat16 bits: one step down is one less in magnitude if positive, one more if not.
    negative = (stored & np.uint16(0x8000)) != 0
    step = np.where(negative, stored + np.uint16(1), stored - np.uint16(1))
    step = np.where(stored == 0, np.uint16(0x8001), step).astype("<u2")
    return np.where(above, step, stored)


def finite_max(dtype: str) -> float:
    """The largest finite value of ``dtype``: decoded values are clipped to it."""
    return {"float16": F16_MAX, "bfloat16": BF16_MAX}.get(dtype, F32_MAX)
