"""MLX arrays for received K/V: carved from large allocations that nothing fills first.

Why: received K/V overwrite every byte of their arrays, yet ``mx.zeros`` (and
``mx.empty``, which fills too) writes each byte first, and each allocation
costs a round trip to a stream thread: 60 arrays of 4 MiB took 14 ms of CPU
here, on a budget the link's copies and AES already spend. MLX has no
uninitialized allocation, but ``mx.load`` reading ``.npy`` from a file-like
object allocates the array and hands its memory straight to the reader's
``readinto``; ``_HeaderOnly`` supplies the header and leaves the data as it
finds it. Each load is a hop to MLX's I/O threads (~0.15 ms), so ``SlabCarver``
loads large slabs and hands out views of them: 60 arrays in 0.5 ms.

A slab is freed once every view of it is gone. mlx-lm replaces a received
array at its first decode step (``KVCache`` grows by concatenating; a full
``RotatingKVCache``'s in-place update copies a shared buffer once, then owns
its copy), so a slab outlives its handoffs by about one step.

If an MLX version reads ``.npy`` otherwise, the arrays are still correct
(contents undefined either way); if it refuses, zero-filled slabs take over.
"""

from __future__ import annotations

import io
import logging
import math
import threading

import mlx.core as mx
import numpy as np

logger = logging.getLogger(__name__)

SLAB_BYTES = 32 * 1024 * 1024  # at most this much is held beyond live arrays, per dtype
_ALIGN_BYTES = 4096  # views start on page boundaries


class _HeaderOnly(io.RawIOBase):
    """A ``.npy`` stream whose data bytes are never written: reads past the header are no-ops."""

    def __init__(self, elements: int, dtype: np.dtype):
        header = io.BytesIO()
        descr = np.lib.format.dtype_to_descr(dtype)
        np.lib.format.write_array_header_1_0(
            header, {"descr": descr, "fortran_order": False, "shape": (elements,)}
        )
        self._header = header.getvalue()
        self._size = len(self._header) + elements * dtype.itemsize
        self._at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._size - self._at))
        if self._at < len(self._header):  # header bytes are real; data bytes are left as found
            head = self._header[self._at : self._at + n]
            view[: len(head)] = head
        self._at += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._size}[whence]
        self._at = base + offset
        return self._at

    def tell(self) -> int:
        return self._at


def unfilled_vector(elements: int, dtype: np.dtype, storage: mx.Dtype,
                    stream: mx.Stream) -> mx.array:
    """An evaluated 1-D MLX array of ``storage`` (numpy ``dtype``'s bytes), contents undefined."""
    try:
        array = mx.load(_HeaderOnly(elements, dtype), format="npy", stream=stream)
        if array.shape == (elements,) and array.dtype == storage:
            return array
        logger.debug("mx.load gave %s %s; using mx.zeros", array.shape, array.dtype)
    except (ValueError, RuntimeError, TypeError) as exc:  # this MLX reads .npy otherwise
        logger.debug("unfilled allocation unavailable (%s); using mx.zeros", exc)
    zeros = mx.zeros((elements,), dtype=storage, stream=stream)
    mx.eval(zeros)
    return zeros


class SlabCarver:
    """Hands out unfilled MLX arrays as views of shared slabs (one current slab per dtype)."""

    def __init__(self, stream: mx.Stream, slab_bytes: int = SLAB_BYTES):
        self._stream, self._slab_bytes = stream, slab_bytes
        self._slabs: dict[np.dtype, tuple[mx.array, int]] = {}  # dtype -> (slab, next element)
        self._lock = threading.Lock()

    def arrays(self, shape: tuple[int, ...], dtype: np.dtype, storage: mx.Dtype,
               count: int) -> list[mx.array]:
        """``count`` evaluated arrays of ``shape``, each its own span of a slab."""
        elements = math.prod(shape)
        step = -(-elements * dtype.itemsize // _ALIGN_BYTES) * _ALIGN_BYTES // dtype.itemsize
        with self._lock:
            slab, at = self._room(dtype, storage, step * count)
            self._slabs[dtype] = (slab, at + step * count)
        views = [slab[at + i * step : at + i * step + elements].reshape(shape)
                 for i in range(count)]
        mx.eval(views)  # slices of an evaluated array: views, no copy
        return views

    def _room(self, dtype: np.dtype, storage: mx.Dtype, elements: int) -> tuple[mx.array, int]:
        slab, at = self._slabs.get(dtype, (None, 0))
        if slab is None or at + elements > slab.size:
            size = max(elements, self._slab_bytes // dtype.itemsize)
            slab, at = unfilled_vector(size, dtype, storage, self._stream), 0
        return slab, at
