"""Where a handoff's layer buffers come from: the engine's memory, a reused pool, or fresh.

In order of preference: the engine's ``kv_buffers`` (received bytes land where
the engine reads them, no copy at adoption), else a ``BufferPool`` (warm pages
reused across handoffs), else plain ``np.empty``. A buffer the engine cannot
give, or gives in the wrong form, fails that handoff with a named error.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mlxcel_plugin.engine_api import KVBufferMaker
from mlxcel_plugin.errors import HandoffError
from mlxcel_plugin.kv_serde.errors import AdoptFailed
from mlxcel_plugin.kv_serde.pool import BufferPool


@dataclass(frozen=True)
class ReceiveMemory:
    pool: BufferPool | None = None
    make_buffers: KVBufferMaker | None = None

    @property
    def room_step(self) -> int:
        """Positions a plain K/V buffer is rounded up to beyond what a handoff fills, where the
        engine's buffers become its decode cache as they are (``kv_room_step`` on its
        ``kv_buffers``: mlx-lm's ``KVCache.step``); 0: no room."""
        return int(getattr(self.make_buffers, "kv_room_step", 0) or 0)

    def take(self, shape: tuple[int, ...], dtype: np.dtype, count: int) -> list[np.ndarray]:
        """``count`` writable C-contiguous arrays of ``shape`` and ``dtype``, contents undefined."""
        if self.make_buffers is not None:
            return self._engine_buffers(shape, dtype, count)
        if self.pool is None:
            return [np.empty(shape, dtype=dtype) for _ in range(count)]
        return [self.pool.take_array(shape, dtype) for _ in range(count)]

    def body(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer for a coded chunk's body until it is decoded (contents undefined):
        a pool slab, warm from earlier bodies, where there is a pool. On the event loop only.

        Why: a fresh buffer of a few MiB is fresh pages again whenever glibc gave the heap
        back, and the decrypt into them faulted each one (~7% of an int8 receive here)."""
        if self.pool is None:
            return np.empty(nbytes, dtype=np.uint8)
        return self.pool.take(nbytes)

    def _engine_buffers(
        self, shape: tuple[int, ...], dtype: np.dtype, count: int
    ) -> list[np.ndarray]:
        try:
            buffers = list(self.make_buffers(shape, dtype, count))
        except HandoffError:
            raise
        except Exception as exc:  # the engine's own failure (say, out of memory)
            raise AdoptFailed(f"engine could not allocate a receive buffer: {exc!r:.200}") from exc
        if len(buffers) != count or not all(_usable(b, shape, dtype) for b in buffers):
            raise AdoptFailed("engine receive buffer is not a writable contiguous array as asked")
        return buffers


def _usable(buffer: object, shape: tuple[int, ...], dtype: np.dtype) -> bool:
    return (
        isinstance(buffer, np.ndarray)
        and buffer.shape == shape
        and buffer.dtype == dtype
        and buffer.flags.c_contiguous
        and buffer.flags.writeable
    )
