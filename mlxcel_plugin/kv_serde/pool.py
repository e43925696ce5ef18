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

Sized from the machine (``pool_bytes_for``), and emptied once the node is
idle (``release_free`` + ``give_back_to_os``): the warm pages help while
handoffs keep coming; held after load they are only RSS.
"""

from __future__ import annotations

import logging
import os
import sys

import numpy as np

from mlxcel_plugin.cache_lines import CACHE_LINE_BYTES, from_cache_line
from mlxcel_plugin.libc import linux_libc

logger = logging.getLogger(__name__)

MIB = 1 << 20
DEFAULT_POOL_BYTES = 512 * MIB
MIN_POOL_BYTES = 64 * MIB
RECEIVE_POOL_MAX_BYTES = 2048 * MIB  # default bound of the MLX receive pool (engine_memory)
_FALLBACK_MACHINE_BYTES = 16 << 30
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
        """A writable uint8 array of ``nbytes`` (contents undefined), starting on a cache line
        (``mlxcel_plugin.cache_lines``; a slab is held whole, so its views count as lent)."""
        slab = self._free_slab(nbytes)
        if slab is not None:
            self.reused += 1
            return from_cache_line(slab, nbytes)
        size = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        if not self._make_room(size + CACHE_LINE_BYTES):
            return np.empty(nbytes, dtype=np.uint8)
        slab = np.empty(size + CACHE_LINE_BYTES, dtype=np.uint8)
        self._slabs.append(slab)
        return from_cache_line(slab, nbytes)

    def take_array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        return self.take(nbytes).view(dtype).reshape(shape)

    def _free_slab(self, nbytes: int) -> np.ndarray | None:
        # Indices, not loop variables: a local name would be one more reference.
        best = None
        for i in range(len(self._slabs)):
            size = self._slabs[i].nbytes
            fits = nbytes + CACHE_LINE_BYTES <= size <= 2 * nbytes + _ALIGN + CACHE_LINE_BYTES
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

    def release_free(self) -> int:
        """Drop every slab nobody holds (their memory goes back to the allocator); bytes freed."""
        free = [i for i in range(len(self._slabs)) if not self._lent(i)]
        freed = sum(self._slabs[i].nbytes for i in free)
        dropped = set(free)
        self._slabs = [s for i, s in enumerate(self._slabs) if i not in dropped]
        return freed


def machine_memory_bytes() -> int:
    """Physical memory of this machine (a 16 GiB guess where the OS will not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return _FALLBACK_MACHINE_BYTES


def pool_bytes_for(kv_budget_bytes: int, model_bytes: int = 0,
                   machine_bytes: int | None = None) -> int:
    """Freed receive buffers worth keeping warm: a few handoffs, not the whole KV budget.

    At most a quarter of the KV budget, a sixteenth of the memory the model
    leaves free, and ``DEFAULT_POOL_BYTES``; at least ``MIN_POOL_BYTES``.
    """
    machine = machine_memory_bytes() if machine_bytes is None else machine_bytes
    spare = max(machine - model_bytes, 0)
    return max(MIN_POOL_BYTES, min(DEFAULT_POOL_BYTES, kv_budget_bytes // 4, spare // 16))


def receive_pool_bytes_for(kv_budget_bytes: int, model_bytes: int = 0,
                           machine_bytes: int | None = None, asked_bytes: int = 0) -> int:
    """Freed receive buffers an MLX decode node keeps faulted in for the next handoffs.

    ``asked_bytes`` (``[engine] receive_pool_bytes``) when set, else a quarter of the KV
    budget, an eighth of the memory the model leaves free, and ``RECEIVE_POOL_MAX_BYTES``
    (at least ``MIN_POOL_BYTES``): one or two 8B-shaped 8k-token handoffs. Never more
    than the KV budget: warm memory is kept instead of KV the node could admit.
    """
    if asked_bytes > 0:
        return min(asked_bytes, kv_budget_bytes)
    machine = machine_memory_bytes() if machine_bytes is None else machine_bytes
    spare = max(machine - model_bytes, 0)
    auto = min(RECEIVE_POOL_MAX_BYTES, kv_budget_bytes // 4, spare // 8)
    return min(max(MIN_POOL_BYTES, auto), kv_budget_bytes)


def give_back_to_os() -> None:
    """Ask glibc to return freed heap pages (large numpy buffers it kept) to the OS.

    Why: glibc raises its mmap threshold after freeing big blocks, so later
    32 MiB buffers come from the heap and stay in RSS after ``free``. A no-op
    off glibc.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _malloc_trim():  # noqa: ANN202 - a ctypes function or None
    return getattr(linux_libc(), "malloc_trim", None)
