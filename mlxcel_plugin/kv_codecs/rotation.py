"""Walsh–Hadamard rotation of K/V rows before quantization.

An orthonormal Hadamard matrix ``H`` (entries ``±1/sqrt(n)``) is symmetric and
its own inverse, so ``rotate`` both applies and undoes it. Rotating each row
spreads an outlier channel over all channels of its block: the rows become
close to Gaussian, a row's (or a rotated channel's) extremes shrink relative to
its spread, and so does the quantization step. The error is orthogonal too: the
decoded rows carry the same squared error as the rotated codes did.

Rows are rotated in blocks of ``rotation_block(head_dim)`` values (a power of
two, at most ``MAX_BLOCK``), so the worst case of one element's error stays
bounded: at most ``block / 2`` steps of its block's scale (see ``quant``).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

MAX_BLOCK = 64


@lru_cache(maxsize=8)
def hadamard(size: int) -> np.ndarray:
    """The orthonormal Sylvester–Hadamard matrix of ``size`` (a power of two), float32."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {size}")
    matrix = np.ones((1, 1), dtype=np.float64)
    while matrix.shape[0] < size:
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    matrix = (matrix / np.sqrt(size)).astype("<f4")
    matrix.flags.writeable = False
    return matrix


def rotation_block(head_dim: int) -> int:
    """The largest power of two dividing ``head_dim``, capped at ``MAX_BLOCK``; 0 below 2."""
    block = min(head_dim & -head_dim, MAX_BLOCK) if head_dim > 0 else 0
    return block if block >= 2 else 0


def is_rotation_block(block: int, head_dim: int) -> bool:
    return 2 <= block <= MAX_BLOCK and not block & (block - 1) and head_dim % block == 0


def rotate(values: np.ndarray, block: int) -> np.ndarray:
    """``values`` ([rows, head_dim], float32) with each run of ``block`` values rotated."""
    blocks = values.reshape(-1, block)
    with np.errstate(over="ignore", invalid="ignore"):
        return (blocks @ hadamard(block)).reshape(values.shape)
