"""Float tensors as float32 and back, in the storage each KV dtype travels in.

bfloat16 travels as its uint16 bits (numpy has no bfloat16); float16 and float32 as
themselves. Quantization works in float32 and stores minimums and outputs back in the
tensor's own dtype.
"""

from __future__ import annotations

import numpy as np

from mlxcel_plugin.kv_codecs.base import CodecError, storage_dtype

F16_MAX = 65504.0
BF16_MAX = float(np.uint32(0x7F7F0000).view(np.float32))
F32_MAX = float(np.finfo(np.float32).max)


def to_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        # bf16 is the top half of an f32: widen, then shift the bits into place (in place).
        bits = np.empty(array.shape, dtype="<u4")
        np.copyto(bits, array, casting="unsafe")
        np.left_shift(bits, 16, out=bits)
        return bits.view("<f4")
    if dtype in ("float16", "float32"):
        return array.astype("<f4", copy=False)  # callers never write into it
    raise CodecError(f"quantization needs a float tensor, got {dtype!r}")


def from_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        bits = values.astype("<f4").view("<u4")
        # Round to nearest even on the 16 dropped bits, as MLX's own cast does.
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
        return rounded.astype("<u2")
    return values.astype(storage_dtype(dtype), copy=False)


def rounded_for_storage(values: np.ndarray, dtype: str) -> np.ndarray:
    """``values`` (float32, overwritten) as an array that ``np.copyto(out, ...,
    casting="unsafe")`` writes into ``dtype``'s storage, rounded to nearest.

    bfloat16: ties away from zero, the bits in each element's low half — two integer
    passes where ``from_float32``'s ties-to-even takes five (measured ~0.23 against
    ~0.5 ns per value). Finite values past the largest bfloat16 must be clipped first."""
    if dtype != "bfloat16":
        return values
    bits = values.view("<u4")
    np.add(bits, np.uint32(0x8000), out=bits)
    np.right_shift(bits, 16, out=bits)
    return bits


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
