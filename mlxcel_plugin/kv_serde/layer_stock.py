"""Receive buffers for several layers taken in one call, handed out a layer at a time.

Why: each call to the engine's buffer maker is a round trip to MLX's I/O threads from the
event loop (0.1-0.2 ms each while the bulk readers run; an 8B-shaped handoff made 32),
and a handoff's layers mostly share one shape. So the first layer of a shape also takes
the buffers of the later layers that may need that shape, as far as the handoff's byte
budget leaves room; those no layer took are dropped with the handoff (``release``).
Only the engine's buffers are taken ahead: a pool's go back to it when a layer is
adopted by copying, and the next layer reuses them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mlxcel_plugin.kv_serde.receive_memory import ReceiveMemory

BufferKey = tuple[tuple[int, ...], np.dtype]


class LayerStock:
    """``ReceiveMemory.take`` with buffers taken ahead for later layers of the same shape."""

    def __init__(self, memory: ReceiveMemory):
        self.memory = memory
        self.held_bytes = 0  # taken ahead, not yet handed out: inside the handoff's budget
        self._held: dict[BufferKey, list[np.ndarray]] = {}

    def take(self, shape: tuple[int, ...], dtype: np.dtype, count: int,
             ahead: Callable[[], int] = lambda: 0) -> list[np.ndarray]:
        """``count`` buffers of ``shape`` (contents undefined): those taken ahead by an earlier
        call, else fresh, with ``ahead()`` x ``count`` more kept for the next calls (asked
        only then: once per shape and handoff)."""
        key = (tuple(shape), np.dtype(dtype))
        held = self._held.get(key, [])
        if len(held) >= count:
            taken, self._held[key] = held[:count], held[count:]
            self.held_bytes -= sum(buffer.nbytes for buffer in taken)
            return taken
        more = ahead() if self.memory.make_buffers is not None else 0
        buffers = self.memory.take(shape, dtype, count * (1 + more))
        kept = buffers[count:]
        if kept:
            self._held[key] = held + kept
            self.held_bytes += sum(buffer.nbytes for buffer in kept)
        return buffers[:count]

    def release(self) -> None:
        """Drop what no layer took (a finished or failed handoff's)."""
        self._held.clear()
        self.held_bytes = 0
