"""Linux memory advice for receive buffers: huge pages under large ones
(``MADV_HUGEPAGE``), and pages faulted in ahead of use (``MADV_POPULATE_WRITE``).

Why: received K/V land in fresh memory (an MLX slab per 64 MiB, freed about
one decode step after its handoff), and the first write to each 4 KiB page
faults. Measured on these machines (``loadtests/bench_kv_handoff.py``, 64 MiB
fp32): 16,382 faults per handoff, and the receiver's bulk thread spent ~4x as
long in them as in AES. With 2 MiB pages a 64 MiB buffer takes 32 faults; the
kernel still zeroes each page, so what goes is the per-page bookkeeping.

Most distributions ship THP as ``madvise`` (used only where asked, as here);
where it is ``never``, or off Linux, the call changes nothing and the buffer
works as before. ``MLXCEL_HUGE_PAGES=0`` turns it off.

Huge pages are not asked for under the small handoffs' shared slabs
(engines/unfilled.py): those are faulted in ahead, a little per decode step, and
one huge-page fault that must compact memory cost up to ~6 ms here (2 MiB at
4 KiB pages: ~2.5 ms), too much for one step's share.

``populate_write`` faults pages in without writing them (Linux 5.14+), so it may
run while another thread writes into the same buffer; elsewhere it does nothing
and those pages fault when first written, as before.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os

import numpy as np

from mlxcel_plugin.libc import linux_libc

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 * 1024 * 1024
PAGE_BYTES = mmap.PAGESIZE
MADV_HUGEPAGE = 14  # <linux/mman.h>
MADV_POPULATE_WRITE = 23
DISABLE_VAR = "MLXCEL_HUGE_PAGES"
NO_MADVISE = -1  # ``_advise``'s answer off Linux or without madvise
_populate_works = [True]  # False once the kernel says it has no MADV_POPULATE_WRITE


def advise_huge_pages(buffer: np.ndarray) -> int:
    """Ask for huge pages under the 2 MiB-aligned part of ``buffer``; the bytes advised."""
    if os.environ.get(DISABLE_VAR) == "0":
        return 0
    start = buffer.ctypes.data
    end = start + buffer.nbytes
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if last <= first or _advise(first, last - first, MADV_HUGEPAGE, "MADV_HUGEPAGE") != 0:
        return 0
    return last - first


def populate_write(buffer: np.ndarray) -> int:
    """Fault in the pages under ``buffer`` writable, contents untouched; the bytes populated
    (0 where the kernel or platform cannot)."""
    if buffer.nbytes == 0 or not _populate_works[0]:
        return 0
    start = buffer.ctypes.data // PAGE_BYTES * PAGE_BYTES
    size = buffer.ctypes.data + buffer.nbytes - start
    failed = _advise(start, size, MADV_POPULATE_WRITE, "MADV_POPULATE_WRITE")
    if failed == errno.EINVAL:  # before Linux 5.14: not asked again (a transient error is)
        _populate_works[0] = False
    return 0 if failed else buffer.nbytes


def _advise(start: int, size: int, advice: int, name: str) -> int:
    """``madvise(start, size, advice)``: 0, or the errno it failed with (``NO_MADVISE``)."""
    madvise = _madvise()
    if madvise is None:
        return NO_MADVISE
    if madvise(ctypes.c_void_p(start), ctypes.c_size_t(size), advice) == 0:
        return 0
    code = ctypes.get_errno()
    logger.debug("madvise(%s) refused: errno %d", name, code)
    return code or NO_MADVISE


@functools.cache
def _madvise():  # noqa: ANN202 - a ctypes function or None
    function = getattr(linux_libc(), "madvise", None)
    if function is not None:
        function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        function.restype = ctypes.c_int
    return function
