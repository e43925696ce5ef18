"""Buffers that start on a 64-byte cache line, for bytes that vector stores write.

Why: received K/V are decrypted (AES-GCM, AVX-512: 64-byte stores) straight into
their receive buffers, and into memory that starts off a cache line every store
spans two lines. Decrypting 256 MiB into warm memory took ~12% more CPU here
starting 8, 16, 32 or 48 bytes past a line than on one (docs/bulk-lanes.md#cache-line-alignment).
glibc's ``malloc`` behind numpy gives large buffers 16 bytes past a line (its chunk
header); MLX's CPU allocator keeps each buffer's size before its data, so MLX arrays
start 8 bytes past a 16-byte boundary (8, 24, 40 or 56 past a line, as measured).
"""

from __future__ import annotations

import numpy as np

CACHE_LINE_BYTES = 64


def padded_elements(elements: int, itemsize: int) -> int:
    """Elements to allocate so that ``elements`` of them fit from the first cache line."""
    return elements + -(-CACHE_LINE_BYTES // itemsize)


def from_cache_line(raw: np.ndarray, elements: int) -> np.ndarray:
    """The 1-D view of ``elements`` of ``raw`` (allocated ``padded_elements`` long) that
    starts on its first cache line (as near as the item size allows)."""
    skip = (-raw.ctypes.data) % CACHE_LINE_BYTES // raw.itemsize
    return raw.reshape(-1)[skip : skip + elements]
