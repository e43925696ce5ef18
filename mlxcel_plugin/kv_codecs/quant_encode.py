"""Encoding kernels of group quantization: group extremes, scales, codes.

The codec (``quant``) runs them on one block of rows at a time (``quant_blocks``), as
few passes over the rows as the scheme allows: the rotated rows' extremes per group
(which also tell whether a rotation left the dtype's range), then one multiply and one
rounding per value. Scales and minimums are small arrays; work on them is free.
"""

from __future__ import annotations

import numpy as np

from mlxcel_plugin.kv_codecs.base import CodecError
from mlxcel_plugin.kv_codecs.floats import F32_MAX, finite_max, round_down, to_float32
from mlxcel_plugin.kv_codecs.groups import DimGroups, TokenGroups
from mlxcel_plugin.kv_codecs.scratch import scratch

SCALE = np.dtype("<f4")
_F16_MIN_NORMAL = 2.0**-14  # below it a float16 scale loses precision
SCALE_F4, SCALE_F2, SCALE_BF16 = "f4", "f2", "bf16"


def group_extremes(
    values: np.ndarray, groups: DimGroups | TokenGroups, asymmetric: bool
) -> tuple[np.ndarray | None, np.ndarray]:
    """(minimum, maximum) of each group; symmetric: (None, maximum |value|)."""
    if asymmetric:
        return groups.reduce(values, np.minimum), groups.reduce(values, np.maximum)
    magnitude = np.abs(values, out=scratch("encode.magnitude", values.shape, values.dtype))
    return None, groups.reduce(magnitude, np.maximum)


def extremes_reach(low: np.ndarray | None, high: np.ndarray) -> float:
    """The largest |value| of the groups (nan where a value was nan)."""
    reach = float(np.abs(high).max(initial=0.0))
    if low is not None:
        reach = max(reach, float(np.abs(low).max(initial=0.0)))
    return reach if np.isfinite(high).all() else float("nan")


def group_ranges(
    low: np.ndarray | None, high: np.ndarray, steps: int, dtype: str, name: str
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray]:
    """(minimums as stored, the same as float32, float32 scales; None, None, scales where
    symmetric) from ``group_extremes``; refuses inf/nan."""
    if low is not None:
        # A stored minimum at or below the true one: codes stay within [0, steps].
        with np.errstate(over="ignore", invalid="ignore"):
            stored_low = round_down(low, dtype)
            low = to_float32(stored_low, dtype)
            scales = ((high - low) / steps).astype(SCALE)
        finite = np.isfinite(scales).all() and np.isfinite(low).all()
    else:
        stored_low = None
        with np.errstate(invalid="ignore"):
            scales = (high / steps).astype(SCALE)
        finite = np.isfinite(scales).all()
    if not finite:
        raise CodecError(f"{name}: tensor holds inf/nan, cannot quantize")
    return stored_low, low, scales


def max_scale(dtype: str, steps: int, asymmetric: bool) -> float:
    """The largest scale an encoder of ``dtype`` data produces (an asymmetric range spans
    up to twice the dtype's max), with slack for float32 rounding."""
    reach = finite_max(dtype) if dtype != "bfloat16" else F32_MAX
    return (2 if asymmetric else 1) * reach / steps * (1 + 2.0**-20)


def narrow_scales(
    scales: np.ndarray, dtype: str, limit: float
) -> tuple[str, np.ndarray, np.ndarray]:
    """(kind, scales as stored, the same as float32): half width where exact enough."""
    if dtype == "bfloat16":
        bits = scales.view("<u4")
        # Round up (never down: a smaller scale would clip the group's max).
        up = ((bits.astype(np.uint64) + 0xFFFF) >> 16).astype("<u2")
        widened = (up.astype("<u4") << 16).view("<f4")
        if (widened <= limit).all():
            return SCALE_BF16, up, widened
    elif dtype == "float16":
        half = scales.astype("<f2")
        half = np.where(half.astype("<f4") < scales, np.nextafter(half, np.inf), half)
        widened = half.astype("<f4")
        usable = (widened == 0) | (widened >= _F16_MIN_NORMAL)
        if usable.all() and (widened <= limit).all():
            return SCALE_F2, half.astype("<f2"), widened
    return SCALE_F4, scales, scales


def quantize(
    values: np.ndarray,
    groups: DimGroups | TokenGroups,
    minimums: np.ndarray | None,
    scales: np.ndarray,
    code_range: tuple[int, int],
) -> np.ndarray:
    """Codes as float32 integers.

    No clip: a scale is at least its group's extent / steps (rounded up when narrowed), a
    stored minimum at most the group's, so value x (1 / scale) rounds within
    ``code_range`` (three float32 roundings add < 2**-21 of a step). A subnormal scale,
    whose inverse overflows, divides and clips instead."""
    codes = scratch("encode.codes", values.shape, "<f4")
    offset = values
    if minimums is not None:
        offset = groups.apply(np.subtract, values, minimums, out=codes)
    with np.errstate(divide="ignore", over="ignore"):
        inverse = np.divide(1.0, scales, out=np.zeros_like(scales), where=scales > 0)
    if np.isfinite(inverse).all():
        groups.apply(np.multiply, offset, inverse, out=codes)
        return np.rint(codes, out=codes)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.rint(groups.apply(np.divide, offset, scales, out=codes))
    codes = np.nan_to_num(codes, nan=0.0, copy=False)  # 0 / 0: a group of zeros
    return np.clip(codes, *code_range, out=codes)
