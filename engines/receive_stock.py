"""Receive arrays made ahead: the next handoff's MLX arrays, allocated and faulted in off its path.

Why: a received tensor of 4 MiB or more lands in an MLX allocation of its own
(``unfilled.own_buffers``: decode then writes its next tokens into it in
place), and each is an ``mx.load``, ~110 µs of CPU and two thread hops, made
on the event loop while the handoff's bytes arrive: 64 per 2k-token handoff of
an 8B-shaped model, ~7 ms, 0.03 CPU-s per GiB. The engine thread makes them
instead, a few between decode steps and all that are due when it runs out of
work, of the shapes recent handoffs took; the event loop takes them ready.
Where MLX's cache holds no freed buffer of an array's size, the array is fresh
memory: it is faulted in as it is made, so the handoff's bytes land in warm
pages.

How many: per shape, as many as the latest burst of takes took (takes less
than ``BURST_GAP_S`` apart are one burst: a handoff's layers, or handoffs
arriving together), the most recently taken shapes first. Bounded by the
receive pool (engines/engine_memory.py) together with MLX's cache of freed
buffers: an array is made only while both hold less than ``max_bytes``, so
the pool's bound still bounds all the memory kept warm for handoffs.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from mlxcel_plugin.huge_pages import advise_huge_pages, populate_write

# Takes further apart than this start a new burst (a 2k-token handoff's 64 arrays are
# asked for within ~150 ms on loopback, ~15 ms apart per layer at 10 Gbit/s and 8k tokens).
BURST_GAP_S = 0.5
# Arrays one engine iteration makes while sequences decode (~0.1 ms each when MLX's cache
# has the memory; a fresh 4 MiB array's faults ~1-2 ms), and when it has run out of work.
RESTOCK_STEP_ARRAYS = 1
RESTOCK_IDLE_ARRAYS = 1 << 20  # all that are due
Key = tuple[tuple[int, ...], str]  # (shape, numpy dtype string)
MakeArray = Callable[[tuple[int, ...], np.dtype, mx.Dtype, mx.Stream], mx.array]


@dataclass
class _Shape:
    storage: mx.Dtype
    nbytes: int
    wanted: int = 0  # arrays the last finished burst took
    burst: int = 0  # arrays taken in the burst under way
    last_take_s: float = 0.0
    ready: list[np.ndarray] = field(default_factory=list)

    @property
    def target(self) -> int:
        return max(self.wanted, self.burst)


class ReceiveStock:
    """Ready receive arrays by shape: ``take`` on the event loop, ``restock`` on the engine
    thread (its own MLX stream, made there: MLX streams belong to a thread)."""

    def __init__(self, max_bytes: int, make_array: MakeArray,
                 cached_bytes: Callable[[], int] = lambda: 0,
                 clock: Callable[[], float] = time.monotonic):
        self.max_bytes = max_bytes
        self._make_array, self._cached_bytes, self._clock = make_array, cached_bytes, clock
        self._shapes: dict[Key, _Shape] = {}
        self._lock = threading.Lock()
        self._stream: mx.Stream | None = None
        self.taken = 0  # arrays handed out ready (tests, metrics)

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes * len(s.ready) for s in self._shapes.values())

    def take(self, shape: tuple[int, ...], dtype: np.dtype, storage: mx.Dtype,
             count: int) -> list[np.ndarray]:
        """Up to ``count`` ready arrays of ``shape`` (writable numpy views of MLX memory,
        contents undefined); the caller makes the rest. Counts the take towards the stock."""
        key, now = (tuple(shape), np.dtype(dtype).str), self._clock()
        with self._lock:
            entry = self._shapes.get(key)
            if entry is None:
                nbytes = math.prod(shape) * np.dtype(dtype).itemsize
                entry = self._shapes[key] = _Shape(storage, nbytes)
            if now - entry.last_take_s > BURST_GAP_S and entry.burst:
                entry.wanted, entry.burst = entry.burst, 0
            entry.burst += count
            entry.last_take_s = now
            ready = [entry.ready.pop() for _ in range(min(count, len(entry.ready)))]
        self.taken += len(ready)
        return ready

    def restock(self, max_arrays: int) -> int:
        """Make up to ``max_arrays`` arrays that are due (engine thread); arrays made."""
        made = 0
        self._drop_unwanted()
        while made < max_arrays:
            due = self._next_due()
            if due is None:
                break
            key, entry = due
            array = self._made(key, entry)
            with self._lock:
                entry.ready.append(array)
            made += 1
        return made

    def clear(self) -> None:
        """Let every ready array go (back to MLX's cache of freed buffers)."""
        with self._lock:
            for entry in self._shapes.values():
                entry.ready.clear()

    def _made(self, key: Key, entry: _Shape) -> np.ndarray:
        if self._stream is None:
            self._stream = mx.new_stream(mx.cpu)
        shape, dtype = key[0], np.dtype(key[1])
        view = np.array(self._make_array(shape, dtype, entry.storage, self._stream), copy=False)
        advise_huge_pages(view)  # before the first write: 2 MiB faults, not 4 KiB
        populate_write(view)  # warm already where MLX's cache gave a freed buffer
        return view

    def _next_due(self) -> tuple[Key, _Shape] | None:
        """The most recently taken shape short of its target, once it fits beside MLX's
        cache in ``max_bytes`` (ready arrays of shapes taken longer ago make room); None
        when none is due."""
        room = self.max_bytes - self._cached_bytes()
        with self._lock:
            by_recency = sorted(self._shapes.items(), key=lambda kv: -kv[1].last_take_s)
            held = sum(s.nbytes * len(s.ready) for _, s in by_recency)
            for rank, (key, entry) in enumerate(by_recency):
                if len(entry.ready) >= entry.target or entry.nbytes > room:
                    continue
                for _, older in reversed(by_recency[rank + 1:]):  # the stalest first
                    while older.ready and held + entry.nbytes > room:
                        older.ready.pop()
                        held -= older.nbytes
                if held + entry.nbytes <= room:
                    return key, entry
        return None

    def _drop_unwanted(self) -> None:
        """Ready arrays beyond their shape's target go; so do shapes with none wanted."""
        with self._lock:
            for key in list(self._shapes):
                entry = self._shapes[key]
                del entry.ready[entry.target:]
                if not entry.target and not entry.ready:
                    del self._shapes[key]
