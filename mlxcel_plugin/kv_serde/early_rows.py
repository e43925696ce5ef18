"""Rows of a layer sent before the layer is whole: each prefill cell's K/V after its forward.

Why: the engine hands a layer to the strategy only after the prompt's last forward, so a
streamed handoff overlapped only that pass, and the tail after prefill grew with the
prompt (48% of an 8k handoff hidden at 10 Gbit/s). A cell's rows are final once its
forward is evaluated, so they can go then.

Only plain ``KVCache`` layers, whose positions are rows: each head's run of tokens
``[first, end)`` is one chunk (or more) at row ``head * tokens + first`` of the layer's
``[kv_heads * tokens, head_dim]`` view. Rows come contiguous from the first position the
handoff ships (a delta's prefix is skipped); the whole layer, when it comes, sends the
rest. The end's checksums are then combined from every chunk's in row order
(``crc32_combine``, as the receiver already does), so where ISA-L is missing no rows go
early and layers ship whole, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mlxcel_plugin.kv_serde.delta import DELTA_CACHE_KIND
from mlxcel_plugin.kv_serde.errors import MalformedHandoff, UnexpectedMessage
from mlxcel_plugin.kv_serde.header import HandoffHeader
from mlxcel_plugin.kv_serde.messages import LayerDescriptor
from mlxcel_plugin.link.protocol.checksum import crc32_combine

ROW_ARRAYS = ("k", "v")


def can_send_early(header: HandoffHeader, index: int) -> bool:
    fp = header.fingerprint
    spec = fp.layers[index]
    return (crc32_combine is not None and fp.cache_classes[index] == DELTA_CACHE_KIND
            and tuple(a.name for a in spec.arrays) == ROW_ARRAYS
            and all(a.grow_axis == 2 for a in spec.arrays))


@dataclass
class EarlyRows:
    """One layer's rows sent so far: up to ``tokens_sent`` of each head, and their crcs."""

    descriptor: LayerDescriptor
    tokens_sent: int = 0  # positions of each head shipped, counted from the delta's prefix
    pieces: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)

    @classmethod
    def for_layer(cls, header: HandoffHeader) -> EarlyRows:
        shipped = header.shipped_tokens
        return cls(LayerDescriptor(shipped, header.prompt_length, {}))

    def take(self, first_token: int, end_token: int, prefix: int) -> tuple[int, int] | None:
        """The shipped positions ``[a, b)`` of absolute tokens ``[first, end)``; None: none."""
        a, b = max(first_token, prefix) - prefix, end_token - prefix
        if b <= a:
            return None
        if a != self.tokens_sent:
            raise UnexpectedMessage(f"rows from token {first_token} after {self.tokens_sent} "
                                    f"of {self.descriptor.tokens} were sent")
        if b > self.descriptor.tokens:
            raise MalformedHandoff(f"rows to token {end_token} beyond the prompt")
        self.tokens_sent = b
        return a, b

    def check_layer(self, index: int, descriptor: LayerDescriptor) -> None:
        if descriptor != self.descriptor:
            raise MalformedHandoff(f"layer {index} does not match the rows sent before it: "
                                   f"{descriptor} != {self.descriptor}")

    def record(self, tensor: str, row: int, crc: int, nbytes: int) -> None:
        self.pieces.setdefault(tensor, {})[row] = (crc, nbytes)

    def crc(self, tensor: str) -> int:
        crc = 0
        for _, (part, nbytes) in sorted(self.pieces.get(tensor, {}).items()):  # row order
            crc = crc32_combine(crc, part, nbytes)
        return crc


def head_runs(array: np.ndarray, tokens: int, first: int) -> list[tuple[int, np.ndarray]]:
    """(layer row, rows) of each head's run in ``array`` ([1, heads, n, width]) from ``first``."""
    return [(head * tokens + first, array[0, head]) for head in range(array.shape[1])]
