"""Whether rotated keys keep the codec's error bound: a cheap proof first, the exact check
only where the proof does not go through.

A rotated key channel mixes every channel of its rotation block over a token run, so a
quiet element's error follows the loudest element of the run. The bound (``quant``):
every element's error within ``bound`` x the larger of its row's and its column's max |x|
(``extent``; the column over the whole chunk).

The proof: rotating back sums the block's rotated errors with weights 1 / sqrt(block),
each at most half its channel's step, so no element of a (run, block) errs by more than
sum(steps) / (2 sqrt(block)). An element's extent is at least its row's root mean square
(rotation keeps a row's norm, so that comes from the rotated rows) and at least its
column's max |x| within this block's rows. Where that worst error fits under ``bound``
times those lower bounds, every element's does; where not (a token far louder than its
run), ``exact_check`` decodes the errors and compares each, as the encoder always did.
Measured on 8B-shaped keys: the proof costs ~0.3 ns per value, the exact check ~2.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from mlxcel_plugin.kv_codecs.groups import TokenGroups
from mlxcel_plugin.kv_codecs.rotation import rotate

# Float32 rounding of decoding and of the lower bounds, generously (both are ~2**-20).
_SLACK = 2.0**-12


def surely_within(
    values: np.ndarray,
    rotated: np.ndarray,
    groups: TokenGroups,
    steps: tuple[np.ndarray, np.ndarray],
    block: int,
    bound: float,
) -> bool:
    """True where no element's error can pass ``bound`` x its extent (``steps``: the
    groups' float32 scales and minimums, [runs, head_dim] each)."""
    scales, minimums = steps
    head_dim = values.shape[1]
    if not values.size:
        return True
    per_block = scales.reshape(-1, head_dim // block, block)
    worst = per_block.sum(axis=2) * (0.5 / math.sqrt(block))
    # Rounding of code x scale + minimum scales with the decoded magnitude.
    magnitude = (np.abs(minimums) + scales * 256).reshape(per_block.shape).max(axis=2)
    worst += magnitude * math.sqrt(block) * _SLACK
    row_rms = np.sqrt(np.einsum("ij,ij->i", rotated, rotated) / head_dim)[:, None]
    row_low = groups.reduce(row_rms, np.minimum) * (1 - _SLACK)
    if np.all(worst <= bound * row_low):
        return True
    column = np.abs(values).max(axis=0)  # a second lower bound, where the first fell short
    column_low = column.reshape(-1, block).min(axis=1) * (1 - _SLACK)
    return bool(np.all(worst <= bound * np.maximum(row_low, column_low)))


def exact_check(
    values: np.ndarray,
    rotated: np.ndarray,
    decoded: np.ndarray,
    block: int,
    bound: float,
    column_extent: Callable[[], np.ndarray],
) -> bool:
    """Every element's decoded error within ``bound`` x its extent (``decoded``: the
    dequantized rotated rows; ``column_extent``: the chunk's column max |x|)."""
    if not values.size:
        return True
    error = np.abs(rotate(decoded - rotated, block))
    extent = np.maximum(np.abs(values).max(axis=1, keepdims=True), column_extent())
    return bool(np.all(error <= bound * extent))
