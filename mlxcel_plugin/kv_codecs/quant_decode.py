"""Decoding one block of group-quantized rows: few passes over cache-sized tiles.

A block (``quant_blocks``, ~512 KiB of float32) goes: codes widened to float32 in one
buffer, scales (and key minimums) applied in place, the rotation back into a second
buffer, a clip only where the body's scales could reach past the dtype's largest value,
then the rounding into the storage dtype, cast in the same pass that copies the rows into
the receiver's own buffer (``place_rows``).
"""

from __future__ import annotations

import math

import numpy as np

from mlxcel_plugin.kv_codecs.floats import finite_max, rounded_for_storage
from mlxcel_plugin.kv_codecs.groups import DimGroups, TokenGroups
from mlxcel_plugin.kv_codecs.rotation import rotate
from mlxcel_plugin.kv_codecs.scratch import scratch

# Float32 rounding of the products and sums behind a decoded value, with room to spare.
_ROUNDING_SLACK = 1 + 2.0**-10


def dequantize(
    codes: np.ndarray,
    groups: DimGroups | TokenGroups,
    scales: np.ndarray,
    minimums: np.ndarray | None,
    head_dim: int,
) -> np.ndarray:
    """The block's quantized rows as float32 [rows, head_dim]: code x scale (+ minimum)."""
    work = scratch("decode.work", (codes.size // head_dim, head_dim), "<f4")
    np.copyto(work, codes.reshape(work.shape), casting="unsafe")
    groups.apply(np.multiply, work, scales, out=work)
    if minimums is not None:
        groups.apply(np.add, work, minimums, out=work)
    return work


def needs_clip(
    scales: np.ndarray, minimums: np.ndarray | None, bits: int, rotation: int, dtype: str
) -> bool:
    """Whether any decoded value could pass ``dtype``'s largest finite value.

    |code| <= 2**bits, so |value| <= 2**bits max(scale) + max|minimum|; a rotated value
    sums ``rotation`` of them over sqrt(rotation). Real caches sit far below: the clip, a
    full pass, runs only for bodies near the top of the range (or hostile ones)."""
    if not scales.size:
        return False
    reach = float(scales.max()) * (1 << bits)
    if minimums is not None and minimums.size:
        reach += float(np.abs(minimums).max())
    if rotation:
        reach *= math.sqrt(rotation)
    return not reach * _ROUNDING_SLACK <= finite_max(dtype)


def restore(values: np.ndarray, rotation: int, clip: bool, dtype: str) -> np.ndarray:
    """Dequantized rows rotated back, clipped if ``clip``, ready for ``place_rows``."""
    if rotation:
        values = rotate(values, rotation, out=scratch("decode.rotated", values.shape, "<f4"))
    if clip:
        limit = finite_max(dtype)
        np.clip(values, -limit, limit, out=values)
    return rounded_for_storage(values, dtype)
