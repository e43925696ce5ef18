"""Walsh–Hadamard rotation of K/V rows before quantization.

An orthonormal Hadamard matrix ``H`` (entries ``±1/sqrt(n)``) is symmetric and
its own inverse, so ``rotate`` both applies and undoes it. Rotating each row
spreads an outlier channel over all channels of its block: the rows become
close to Gaussian, a row's (or a rotated channel's) extremes shrink relative to
its spread, and so does the quantization step. The error is orthogonal too: the
decoded rows carry the same squared error as the rotated codes did.

Rows are rotated in blocks of ``rotation_block(head_dim, cap)`` values (a power
of two, at most the tensor's ``ENCODE_BLOCKS`` cap), so the worst case of one
element's error stays bounded: at most ``block / 2`` steps of its block's scale
(see ``quant``). Decoders take any block up to ``MAX_BLOCK``: encoders before
keys' cap was 16 sent keys in 64 too.

Why keys in 16, values in 64, and a matrix product: measured on one x86 core
(NumPy's OpenBLAS, one thread, as nodes run it), rotating float32 rows costs
~1.3-1.8 ns per value in blocks of 64, ~0.8-0.9 in blocks of 32 and ~0.5 in
blocks of 16 (the product's work grows with the block; BLAS stays efficient down
to 16, not below: 8 costs ~0.9). A butterfly (fast Walsh-Hadamard) transform in
NumPy passes costs ~14 ns per value: its short strided passes are all overhead.
Values in blocks of 16 cost quality on SmolLM2, keys did not (see ``quant``).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

MAX_BLOCK = 64  # the largest block a decoder accepts
# The largest block this encoder rotates each tensor's rows in (K, V).
ENCODE_BLOCKS = {"k": 16, "v": 64}
ENCODE_BLOCK = ENCODE_BLOCKS["k"]  # the smallest of them


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


def rotation_block(head_dim: int, cap: int = ENCODE_BLOCK) -> int:
    """The largest power of two dividing ``head_dim``, capped at ``cap``; 0 below 2."""
    block = min(head_dim & -head_dim, cap) if head_dim > 0 else 0
    return block if block >= 2 else 0


def is_rotation_block(block: int, head_dim: int) -> bool:
    return 2 <= block <= MAX_BLOCK and not block & (block - 1) and head_dim % block == 0


def rotate(values: np.ndarray, block: int, out: np.ndarray | None = None) -> np.ndarray:
    """``values`` ([rows, head_dim], float32) with each run of ``block`` values rotated
    (into ``out``, contiguous float32 of the same shape, when given)."""
    if out is None:
        out = np.empty(values.shape, dtype="<f4")
    with np.errstate(over="ignore", invalid="ignore"):
        np.matmul(values.reshape(-1, block), hadamard(block), out=out.reshape(-1, block))
    return out
