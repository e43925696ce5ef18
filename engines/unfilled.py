"""MLX arrays for received K/V: carved from large allocations that nothing fills first.

Why: received K/V overwrite every byte of their arrays, yet ``mx.zeros`` (and
``mx.empty``, which fills too) writes each byte first, and each allocation
costs a round trip to a stream thread: 60 arrays of 4 MiB took 14 ms of CPU
here, on a budget the link's copies and AES already spend. MLX has no
uninitialized allocation, but ``mx.load`` reading ``.npy`` from a file-like
object allocates the array and hands its memory straight to the reader's
``readinto``; ``_HeaderOnly`` supplies the header and leaves the data as it
finds it. Each load is a hop to MLX's I/O threads (~0.15 ms), so ``SlabCarver``
loads large slabs and hands out numpy views of them, and ``mlx_view`` turns
a view back into a lazy MLX slice when its layer is adopted: 60 arrays in
0.5 ms, against 5-14 ms zero-filling them one layer at a time.

A slab is freed once every view of it is gone. mlx-lm replaces a received
array at its first decode step (``KVCache`` grows by concatenating; a full
``RotatingKVCache``'s in-place update copies a shared buffer once, then owns
its copy), so a slab outlives its handoffs by about one step.

If an MLX version reads ``.npy`` otherwise, the arrays are still correct
(contents undefined either way); if it refuses, zero-filled slabs take over.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import struct
import threading
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxcel_plugin.cache_lines import from_cache_line, padded_elements
from mlxcel_plugin.huge_pages import advise_huge_pages, populate_write

logger = logging.getLogger(__name__)

# At most this much is held beyond live arrays, per dtype. Each new slab is a hop to MLX's I/O
# threads that waits for the GIL (1-3 ms under load, in the body sink): one per 64 MiB received.
SLAB_BYTES = 64 * 1024 * 1024
_ALIGN_BYTES = 4096  # views start on page boundaries of the slab (which starts on a cache line)
# Arrays this large get an allocation each (decode then writes into them in place); one
# mx.load each (~0.1 ms of CPU) is small beside the first decode step's copy of a slab view
# it saves: from 4 MiB down to 1 MiB, the engine's share of an 8B-shaped handoff (its thread
# and MLX's it started) fell from 26-31 to 10-17 ms at 1k tokens, 17-21 to 12-13 at 512
# (bench_kv_plane, alternating).
OWN_ALLOCATION_BYTES = 1024 * 1024
# The MLX storage dtypes received K/V come in, as safetensors names them (unfilled_vectors).
_SAFETENSORS_DTYPES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16",
                       mx.uint16: "U16", mx.uint32: "U32", mx.uint8: "U8"}
# Slab memory faulted in ahead of the next view (SlabCarver.prefault), and how much of it one
# engine iteration faults while sequences decode (~0.25 ms of CPU here; idle: all of it).
PREFAULT_AHEAD_BYTES = 16 * 1024 * 1024
PREFAULT_STEP_BYTES = 256 * 1024


class _HeaderOnly(io.RawIOBase):
    """A file of ``header`` then ``data_bytes`` never written: reads past the header are
    no-ops."""

    def __init__(self, header: bytes, data_bytes: int):
        self._header = header
        self._size = len(header) + data_bytes
        self._at = 0

    @classmethod
    def npy(cls, shape: tuple[int, ...], dtype: np.dtype) -> _HeaderOnly:
        """One ``.npy`` array of ``shape`` and ``dtype``."""
        header = io.BytesIO()
        descr = np.lib.format.dtype_to_descr(dtype)
        np.lib.format.write_array_header_1_0(
            header, {"descr": descr, "fortran_order": False, "shape": shape}
        )
        return cls(header.getvalue(), math.prod(shape) * dtype.itemsize)

    @classmethod
    def safetensors(cls, code: str, elements: int, itemsize: int, count: int) -> _HeaderOnly:
        """``count`` 1-D tensors "0", "1", ... of ``elements`` each, safetensors dtype ``code``."""
        size = elements * itemsize
        meta = {str(i): {"dtype": code, "shape": [elements],
                         "data_offsets": [i * size, (i + 1) * size]} for i in range(count)}
        header = json.dumps(meta).encode()
        header += b" " * (-len(header) % 8)
        return cls(struct.pack("<Q", len(header)) + header, count * size)

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
    return unfilled_array((elements,), dtype, storage, stream)


def unfilled_array(shape: tuple[int, ...], dtype: np.dtype, storage: mx.Dtype,
                   stream: mx.Stream) -> mx.array:
    """An evaluated MLX array of ``shape`` and ``storage``, its own allocation, unfilled."""
    try:
        array = mx.load(_HeaderOnly.npy(tuple(shape), dtype), format="npy", stream=stream)
        if array.shape == tuple(shape) and array.dtype == storage:
            return array
        logger.debug("mx.load gave %s %s; using mx.zeros", array.shape, array.dtype)
    except (ValueError, RuntimeError, TypeError) as exc:  # this MLX reads .npy otherwise
        logger.debug("unfilled allocation unavailable (%s); using mx.zeros", exc)
    zeros = mx.zeros(tuple(shape), dtype=storage, stream=stream)
    mx.eval(zeros)
    return zeros


def unfilled_vectors(elements: int, dtype: np.dtype, storage: mx.Dtype, count: int,
                     stream: mx.Stream) -> list[mx.array]:
    """``count`` evaluated 1-D arrays as ``unfilled_vector``'s, each its own allocation, in
    one hop to MLX's I/O threads: the loads of a header-only ``.safetensors`` file.

    Why: a decode node allocates a handoff's K and V per layer on its event loop, and
    each hop waits for the GIL there: 0.1-0.2 ms each while the bulk readers run."""
    code = _SAFETENSORS_DTYPES.get(storage)
    if count > 1 and code is not None:
        try:
            loaded = mx.load(_HeaderOnly.safetensors(code, elements, dtype.itemsize, count),
                             format="safetensors", stream=stream)
            arrays = [loaded[str(i)] for i in range(count)]
            mx.eval(arrays)
            if all(a.shape == (elements,) and a.dtype == storage for a in arrays):
                return arrays
            logger.debug("safetensors load gave other arrays; loading one by one")
        except (ValueError, RuntimeError, TypeError, KeyError) as exc:
            logger.debug("batched unfilled allocation unavailable (%s)", exc)
    return [unfilled_vector(elements, dtype, storage, stream) for _ in range(count)]


def unfilled_from_cache_line(elements: int, dtype: np.dtype, storage: mx.Dtype,
                             stream: mx.Stream, count: int = 1) -> list[np.ndarray]:
    """``count`` writable 1-D numpy views of ``elements``, each of a fresh MLX allocation,
    unfilled, starting on a cache line (MLX's own start is off one:
    ``mlxcel_plugin.cache_lines``)."""
    raws = unfilled_vectors(padded_elements(elements, dtype.itemsize), dtype, storage, count,
                            stream)
    return [from_cache_line(np.array(raw, copy=False), elements) for raw in raws]


def own_buffers(shape: tuple[int, ...], dtype: np.dtype, storage: mx.Dtype, count: int,
                stream: mx.Stream) -> list[np.ndarray]:
    """``count`` arrays each in an MLX allocation of its own, as writable numpy views.

    Why not slab views: MLX writes into an array in place (a decode step's new token)
    only while no other array shares its memory; a slab shared by several tensors makes
    the first decode step copy each of them. The view starting a few bytes into its
    allocation does not stop that: adopted, it is the allocation's only array.
    """
    out = []
    for vector in unfilled_from_cache_line(math.prod(shape), dtype, storage, stream, count):
        view = vector.reshape(shape)
        advise_huge_pages(view)  # before any byte is written: 2 MiB faults, not 4 KiB
        out.append(view)
    return out


@dataclass
class _Slab:
    """One slab: views are carved from ``at`` on; pages below ``faulted`` are faulted in."""

    array: np.ndarray
    at: int = 0  # elements
    faulted: int = 0  # elements

    @property
    def left(self) -> int:
        return self.array.size - self.at


class SlabCarver:
    """Hands out unfilled MLX memory as numpy views of shared slabs (one current slab per dtype).

    Carving is numpy slicing: no MLX work, so no round trip to a stream
    thread per layer (under load one took up to 5 ms here). ``mlx_view``
    turns such a view back into MLX, lazily, when the layer is adopted.

    Warm ahead: received bytes would otherwise be the first write to their pages,
    and a 2 MB handoff faulting 4 KiB pages cost ~2 ms of the decode machine's CPU
    inside one decode step (docs/bulk-lanes.md#receive-pool). ``prefault`` (the
    engine thread, a little per step) faults in up to ``PREFAULT_AHEAD_BYTES``
    past the next view, in the current slab and in the next one, which is
    allocated (unfilled, not faulted) once the current one runs low.
    """

    def __init__(self, stream: mx.Stream, slab_bytes: int = SLAB_BYTES):
        self._stream, self._slab_bytes = stream, slab_bytes
        self._slabs: dict[np.dtype, _Slab] = {}  # dtype -> the slab views are carved from
        self._next: dict[np.dtype, _Slab] = {}  # dtype -> the slab after it, once allocated
        self._lock = threading.Lock()

    def buffers(self, shape: tuple[int, ...], dtype: np.dtype, storage: mx.Dtype,
                count: int) -> list[np.ndarray]:
        """``count`` writable arrays of ``shape``, each its own page-aligned span of a slab
        (from ``OWN_ALLOCATION_BYTES`` each: an allocation each, ``own_buffers``)."""
        elements = math.prod(shape)
        if elements * dtype.itemsize >= OWN_ALLOCATION_BYTES:
            return own_buffers(shape, dtype, storage, count, self._stream)
        step = -(-elements * dtype.itemsize // _ALIGN_BYTES) * _ALIGN_BYTES // dtype.itemsize
        with self._lock:
            slab = self._room(dtype, storage, step * count)
            at, slab.at = slab.at, slab.at + step * count
            if slab.left * dtype.itemsize < PREFAULT_AHEAD_BYTES and dtype not in self._next:
                self._next[dtype] = self._new_slab(dtype, storage, 0)  # warmed before it is used
        return [slab.array[at + i * step : at + i * step + elements].reshape(shape)
                for i in range(count)]

    def prefault(self, max_bytes: int) -> int:
        """Fault in up to ``max_bytes`` of the memory the next views will take (pages only:
        no byte changes, so views being written meanwhile are safe); the bytes faulted."""
        with self._lock:
            spans = self._spans_to_fault(max_bytes)
        return sum(populate_write(span) for span in spans)

    def _spans_to_fault(self, max_bytes: int) -> list[np.ndarray]:
        spans = []
        for dtype, slab in self._slabs.items():
            ahead = PREFAULT_AHEAD_BYTES // dtype.itemsize
            next_slab = self._next.get(dtype)
            plan = [(slab, slab.at + ahead)]
            if next_slab is not None:
                plan.append((next_slab, ahead - slab.left))
            for part, until in plan:
                start = max(part.faulted, part.at)
                stop = min(until, part.array.size, start + max_bytes // dtype.itemsize)
                if stop > start:
                    spans.append(part.array[start:stop])
                    part.faulted = stop
                    max_bytes -= (stop - start) * dtype.itemsize
        return spans

    def _room(self, dtype: np.dtype, storage: mx.Dtype, elements: int) -> _Slab:
        slab = self._slabs.get(dtype)
        if slab is None or elements > slab.left:
            slab = self._next.pop(dtype, None)
            if slab is None or elements > slab.left:
                slab = self._new_slab(dtype, storage, elements)
            self._slabs[dtype] = slab
        return slab

    def _new_slab(self, dtype: np.dtype, storage: mx.Dtype, elements: int) -> _Slab:
        size = max(elements, self._slab_bytes // dtype.itemsize)
        return _Slab(unfilled_from_cache_line(size, dtype, storage, self._stream)[0])


def mlx_view(x: np.ndarray, stream: mx.Stream | None = None) -> mx.array | None:
    """The MLX array whose memory ``x`` (a contiguous view of MLX memory) shows, or None.

    The whole array when ``x`` covers it, else a lazy slice of it on
    ``stream``: no copy, and no MLX work until the array is used. MLX streams
    belong to a thread, so ``stream`` must be one of the thread that will
    evaluate the slice (None: the caller's).
    """
    if not x.flags.c_contiguous:
        return None
    return _owner_span(x, x.shape, stream)


def mlx_room_view(x: np.ndarray, stream: mx.Stream | None = None
                  ) -> tuple[mx.array, mx.array] | None:
    """For ``x`` = ``full[:, :, :T, :]`` of a contiguous ``[1, heads, room, dim]`` view of
    MLX memory (a receive buffer with room): (the lazy MLX slice ``x`` shows, ``full`` as
    MLX), no copy; None otherwise. ``stream``: as for ``mlx_view``."""
    if x.ndim != 4 or x.shape[0] != 1 or x.flags.c_contiguous:
        return None
    heads, tokens, dim = x.shape[1:]
    room, rem = divmod(x.strides[1], dim * x.itemsize)
    if rem or room <= tokens or x.strides[2:] != (dim * x.itemsize, x.itemsize):
        return None
    full = _owner_span(x, (1, heads, room, dim), stream)
    if full is None:
        return None
    with contextlib.nullcontext() if stream is None else mx.stream(stream):
        return full[:, :, :tokens, :], full


def _owner_span(x: np.ndarray, shape: tuple[int, ...], stream: mx.Stream | None
                ) -> mx.array | None:
    """The MLX array of ``shape`` (C order) starting where ``x``'s data does, within the MLX
    array ``x`` is a numpy view of; None where ``x`` is not such a view."""
    memory = x.base
    while isinstance(memory, np.ndarray):  # a view of a view (of a slab)
        memory = memory.base
    owner = memory.obj if isinstance(memory, memoryview) else None
    if not isinstance(owner, mx.array) or owner.itemsize != x.itemsize:
        return None
    if not memory.c_contiguous:  # a strided MLX array's export (a sliced cache): not a slab
        return None
    offset = x.ctypes.data - np.frombuffer(memory, dtype=np.uint8).ctypes.data
    start, rem = divmod(offset, x.itemsize)
    size = math.prod(shape)
    if rem or start < 0 or start + size > owner.size:
        return None
    if owner.shape == tuple(shape):
        return owner
    with contextlib.nullcontext() if stream is None else mx.stream(stream):
        return owner.reshape(-1)[start : start + size].reshape(shape)  # basic slicing: a view
