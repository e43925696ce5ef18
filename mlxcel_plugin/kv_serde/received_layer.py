"""One layer of a handoff being received: its buffers, which rows have arrived, its checksums.

Once both tensors are whole and checksummed, the layer is handed to the
engine's adopter (``engine_api.LayerAdopter``), which copies it into the
engine's own arrays while later layers are still on the wire; the receive
buffers are dropped then, so they go back to the pool after one layer, not
after the whole cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlxcel_plugin.engine_api import CacheLayer, LayerAdopter
from mlxcel_plugin.errors import HandoffError
from mlxcel_plugin.kv_serde.errors import AdoptFailed
from mlxcel_plugin.kv_serde.messages import LayerDescriptor
from mlxcel_plugin.link.protocol.checksum import crc32, crc32_combine


@dataclass
class ReceivedLayer:
    descriptor: LayerDescriptor
    kind: str  # mlx-lm cache class, from the fingerprint
    dtype: str
    # Array name ("k", "v", "s0", ...) -> its buffer, in the layer spec's order; {} once adopted.
    tensors: dict[str, np.ndarray]
    claimed: dict[str, np.ndarray]  # name -> bool per row: filled, or a body's destination
    rows_left: dict[str, int]  # name -> rows not yet filled
    crcs: dict[str, int] = field(default_factory=dict)  # of each tensor once it is complete
    # tensor -> {row: (crc32, bytes)} of chunks whose crc was taken as they landed in place.
    landed_crcs: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)
    adopted: CacheLayer | None = None
    # The sender's checksums cover chunk bodies as sent (``checksum_of = "encoded"``).
    crc_of_bodies: bool = False
    # False for ``checksum_of = "none"``: AES-GCM authenticated the bytes, no crc is taken.
    checksummed: bool = True

    @property
    def complete(self) -> bool:
        return not any(self.rows_left.values())

    def rows(self, tensor: str) -> int:
        return int(self.claimed[tensor].size)

    def rows_views(self, tensor: str, row: int, rows: int) -> list[memoryview]:
        """The bytes of rows ``[row, row + rows)`` of ``tensor`` (rows of ``[-1, shape[-1]]``):
        one view, or one per head where the buffer has room after each head's tokens."""
        return [memoryview(part).cast("B") for part in row_segments(self.tensors[tensor],
                                                                     row, rows)]

    def tensor_filled(self, tensor: str, row: int, rows: int, landed_crc: int | None = None,
                      body: Any = b"") -> bool:
        """Count rows ``[row, row + rows)`` of ``tensor`` in; True when it just became whole.

        ``landed_crc`` is the crc32 of ``body``, taken where it landed in this
        layer's buffer; when every chunk of a tensor has one, its checksum is
        combined from them instead of reading the tensor again. Checksums of
        bodies (``crc_of_bodies``) are always combined from the chunks' bodies.
        """
        if not self.checksummed:
            self.rows_left[tensor] -= rows
            return not self.rows_left[tensor]
        if self.crc_of_bodies and landed_crc is None:
            landed_crc = crc32(body)
        if landed_crc is not None:
            self.landed_crcs.setdefault(tensor, {})[row] = (landed_crc, len(body))
        self.rows_left[tensor] -= rows
        if self.rows_left[tensor]:
            return False
        # As soon as it is whole: the checksum overlaps the rest of the transfer.
        self.crcs[tensor] = self._tensor_crc(tensor)
        return True

    def _tensor_crc(self, tensor: str) -> int:
        landed = self.landed_crcs.pop(tensor, {})
        whole = sum(n for _, n in landed.values()) == self.tensors[tensor].nbytes
        if crc32_combine is None or not (whole or self.crc_of_bodies):
            return crc32(memoryview(self.tensors[tensor]).cast("B"))  # contiguous: no room
        crc = 0
        for _, (part_crc, nbytes) in sorted(landed.items()):  # in row order
            crc = crc32_combine(crc, part_crc, nbytes)
        return crc

    def cache_layer(self) -> CacheLayer:
        if self.adopted is not None:
            return self.adopted
        return CacheLayer.of_arrays(
            self.kind, self.tensors, self.dtype, self.descriptor.offset, self.descriptor.meta
        )

    def adopt(self, adopter: LayerAdopter) -> None:
        """Hand the whole layer to the engine's adopter and let go of the receive buffers."""
        try:
            self.adopted = adopter(self.cache_layer())
        except HandoffError:
            raise
        except Exception as exc:  # the engine's own failure (say, out of memory) fails this handoff
            raise AdoptFailed(f"engine could not take a received layer: {exc!r:.200}") from exc
        self.tensors = {}


def row_segments(tensor: np.ndarray, row: int, rows: int) -> list[np.ndarray]:
    """Rows ``[row, row + rows)`` of ``tensor`` viewed as ``[-1, shape[-1]]``, as contiguous
    pieces: one for a contiguous buffer; per head for ``[1, heads, tokens, width]`` cut from
    a buffer with room (``layer_buffers``), where row ``h * tokens + t`` is head h, token t."""
    if tensor.flags.c_contiguous:
        return [tensor.reshape(-1, tensor.shape[-1])[row : row + rows]]
    tokens, pieces, end = tensor.shape[2], [], row + rows
    while row < end:
        head, token = divmod(row, tokens)
        n = min(end - row, tokens - token)
        pieces.append(tensor[0, head, token : token + n])
        row += n
    return pieces
