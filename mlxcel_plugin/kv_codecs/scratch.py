"""Per-thread scratch buffers for the quantizing codecs' block-sized temporaries.

Why: a block's temporaries are a few MiB each. Fresh arrays of that size come from
``mmap`` or from heap the allocator may have handed back to the OS, and then every
call faults its pages in again: measured on SmolLM2-shaped float16 KV, int8 decoding
ran at ~5 CPU-s/GiB with fresh temporaries and ~2 with these (first-touch costs
~2.7 s per GiB on this kind of machine, issue 40). Each thread that codes keeps its
own buffers (a lane thread, the event loop): at most one per name, as large as the
largest block it coded — with ``quant_blocks.BLOCK_BYTES`` of 2 MiB, a few MiB per
thread, for the thread's life.
"""

from __future__ import annotations

import math
import threading

import numpy as np

_local = threading.local()


def scratch(name: str, shape: tuple[int, ...], dtype: str | np.dtype) -> np.ndarray:
    """This thread's buffer ``name`` as an uninitialised array of ``shape`` and ``dtype``
    (valid until the next call for the same name on this thread)."""
    pool: dict[str, np.ndarray] = _local.__dict__.setdefault("pool", {})
    dtype = np.dtype(dtype)
    size = math.prod(shape) * dtype.itemsize
    buffer = pool.get(name)
    if buffer is None or buffer.size < size:
        buffer = pool[name] = np.empty(max(size, 1), dtype=np.uint8)
    return buffer[:size].view(dtype).reshape(shape)
