"""Where a handoff's layer buffers come from: the engine's memory, a reused pool, or fresh.

In order of preference: the engine's ``kv_buffer`` (received bytes land where
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
    make_buffer: KVBufferMaker | None = None

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A writable C-contiguous array of ``shape`` and ``dtype`` (contents undefined)."""
        if self.make_buffer is not None:
            return self._engine_buffer(shape, dtype)
        if self.pool is None:
            return np.empty(shape, dtype=dtype)
        return self.pool.take_array(shape, dtype)

    def _engine_buffer(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        try:
            buffer = self.make_buffer(shape, dtype)
        except HandoffError:
            raise
        except Exception as exc:  # the engine's own failure (say, out of memory)
            raise AdoptFailed(f"engine could not allocate a receive buffer: {exc!r:.200}") from exc
        usable = (
            isinstance(buffer, np.ndarray)
            and buffer.shape == shape
            and buffer.dtype == dtype
            and buffer.flags.c_contiguous
            and buffer.flags.writeable
        )
        if not usable:
            raise AdoptFailed("engine receive buffer is not a writable contiguous array as asked")
        return buffer
