"""Decoding one block of group-quantized rows: in one compiled pass, or few NumPy passes.

``decode_block_into`` runs the compiled decoder (``quant_kernel``) where it is built, and
otherwise these NumPy passes over cache-sized tiles. A block (``quant_blocks``, ~2 MiB of
float32) goes: codes widened to float32 in one
buffer, scales (and key minimums) applied in place, the rotation back into a second
buffer, a clip only where the body's scales could reach past the dtype's largest value,
then the rounding into the storage dtype, cast in the same pass that copies the rows into
the receiver's own buffer (``place_rows``).
"""

from __future__ import annotations

import math

import numpy as np

from mlxcel_plugin.kv_codecs import quant_kernel
from mlxcel_plugin.kv_codecs.floats import finite_max, rounded_for_storage
from mlxcel_plugin.kv_codecs.groups import DimGroups, TokenGroups
from mlxcel_plugin.kv_codecs.quant_blocks import Block, place_rows
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


def decode_block_into(
    target: np.ndarray,
    block: Block,
    codes: np.ndarray,
    steps: tuple[np.ndarray, np.ndarray | None],
    exact_values: np.ndarray,
    rotation: int,
    clip: bool,
    dtype: str,
    at: np.ndarray | None = None,
) -> bool:
    """One block's rows into ``target`` (the receiver's buffer, storage dtype): exact rows as
    they came, the others decoded (``steps``: the block's float32 scales and minimums or
    None). Row for row where ``at`` is None. ``at``: the rows of ``target`` they go to, where
    ``target`` is the pieces of a buffer with room seen as one span (``spanning_rows``):
    a whole chunk in one call of the compiled decoder instead of one per head (the same
    arithmetic without each call's fixed NumPy work); only that decoder takes these, so
    False (nothing written) where it is not built or does not take the block."""
    scales, minimums = steps
    if target.dtype.itemsize == 2:  # the storage's bits: written and copied as bits
        target, exact_values = target.view("<u2"), exact_values.view("<u2")
    decoded, exact_rows = _rows_of(block.exact, at)
    limit = finite_max(dtype) if clip else float("inf")
    if quant_kernel.decode_block(codes, codes.dtype.kind == "i", block.groups, scales,
                                 minimums, rotation, limit, target, decoded, dtype):
        if exact_rows is not None:  # only the rows named: a span has others
            target[exact_rows] = exact_values.reshape(-1, target.shape[1])
        return True
    if at is not None:
        return False
    values = dequantize(codes, block.groups, scales, minimums, target.shape[1])
    place_rows(target, block.exact, exact_values, restore(values, rotation, clip, dtype))
    return True


def _rows_of(exact: np.ndarray | None, at: np.ndarray | None
             ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(the target rows of the decoded rows, of the exact rows); None: row for row, or none."""
    if exact is None:
        return at, None
    if at is None:
        return np.flatnonzero(~exact), np.flatnonzero(exact)
    return at[~exact], at[exact]
