"""Receive buffers reused across handoffs, so their pages are faulted in once.

Why: a fresh ``np.empty`` of a layer's size is fresh ``mmap`` memory, and the
first write to each page faults — copying 64 MiB into new memory took 32 ms
here, into reused memory 3.4 ms, against ~25 ms for the bytes to cross
loopback TCP.

A slab is lent as a numpy view. Every view of it — and every view of such a
view, memoryviews and frames included — holds the slab as its ``base``, so a
slab is free again exactly when nobody but the pool refers to it: after the
assembler dropped a failed handoff, or after the engine copied the arrays into
MLX. Nothing has to be given back explicitly, and memory still referenced
anywhere (say, by a bulk read in flight) is never lent twice.
"""

from __future__ import annotations

import sys

import numpy as np

MIB = 1 << 20
DEFAULT_POOL_BYTES = 512 * MIB
_ALIGN = 64 * 1024
# References to a free slab while ``_lent`` looks at it: the pool's list and
# getrefcount's argument.
_FREE_REFS = 2


class BufferPool:
    """A bounded set of byte slabs lent out by ``take``; single-threaded (the event loop).

    ``take(n)`` lends the smallest free slab of n to 2n bytes, else a new one
    while the pool holds under ``max_bytes`` (lent and free together), else
    unpooled memory; free slabs are dropped to make room for a new size.
    """

    def __init__(self, max_bytes: int = DEFAULT_POOL_BYTES):
        self.max_bytes = max_bytes
        self._slabs: list[np.ndarray] = []
        self.reused = 0  # takes served by a slab lent before (for tests and metrics)

    @property
    def held_bytes(self) -> int:
        return sum(slab.nbytes for slab in self._slabs)

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of ``nbytes`` (contents undefined)."""
        slab = self._free_slab(nbytes)
        if slab is not None:
            self.reused += 1
            return slab[:nbytes]
        size = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        if not self._make_room(size):
            return np.empty(nbytes, dtype=np.uint8)
        slab = np.empty(size, dtype=np.uint8)
        self._slabs.append(slab)
        return slab[:nbytes]

    def take_array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        return self.take(nbytes).view(dtype).reshape(shape)

    def _free_slab(self, nbytes: int) -> np.ndarray | None:
        # Indices, not loop variables: a local name would be one more reference.
        best = None
        for i in range(len(self._slabs)):
            size = self._slabs[i].nbytes
            fits = nbytes <= size <= 2 * nbytes + _ALIGN
            if fits and (best is None or size < self._slabs[best].nbytes) and not self._lent(i):
                best = i
        return None if best is None else self._slabs[best]

    def _make_room(self, size: int) -> bool:
        """Drop free slabs (largest first) until ``size`` more bytes fit; False if they can't."""
        held = self.held_bytes
        order = sorted(range(len(self._slabs)), key=lambda i: self._slabs[i].nbytes, reverse=True)
        dropped = set()
        for i in order:
            if held + size <= self.max_bytes:
                break
            if not self._lent(i):
                dropped.add(i)
                held -= self._slabs[i].nbytes
        self._slabs = [s for i, s in enumerate(self._slabs) if i not in dropped]
        return held + size <= self.max_bytes

    def _lent(self, index: int) -> bool:
        return sys.getrefcount(self._slabs[index]) > _FREE_REFS
