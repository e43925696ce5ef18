"""A coded chunk decoded where its body lands: on the link's bulk thread, not the event loop.

Why: an int8 handoff's decode is most of the receiver's CPU (each byte is
widened, scaled and rotated), and on the event loop it stalled every other
link and the decode node's token streams while it ran. The assembler reserves
the chunk's rows when the link asks where the body goes (``chunk_destination``),
hands back a ``LandedDecode`` — a fresh buffer for the body and the decode to
run once the body is in — and the bulk thread calls it as soon as the
chunk's last record is authenticated, while later records still arrive. The
codec's decode releases the GIL where it is numpy or BLAS work.

``feed`` later finds the chunk decoded already (or re-raises the decode's
error there, so it fails the handoff on the loop like any other refusal). A
body that came another way (the WebSocket, a body the link could not place)
is decoded by ``feed`` as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from mlxcel_plugin.errors import HandoffError
from mlxcel_plugin.kv_codecs import CorruptChunk, IdentityCodec, KVCodec
from mlxcel_plugin.kv_serde.chunk_body import decode_chunk_into
from mlxcel_plugin.kv_serde.errors import OversizeDeclared
from mlxcel_plugin.kv_serde.layer_spec import ArraySpec
from mlxcel_plugin.kv_serde.messages import ChunkHeader
from mlxcel_plugin.kv_serde.receive_memory import ReceiveMemory

# (layer, tensor, first row): a chunk's place in its handoff.
ChunkKey = tuple[int, str, int]
_SLACK_BYTES = 4096  # a compressor's frame overhead on a tiny chunk


@dataclass
class LandedDecode:
    """One chunk's body buffer and the decode of it into its rows, run by ``__call__``."""

    key: ChunkKey
    body: memoryview
    decode: Callable[[memoryview], None]
    done: bool = False
    error: HandoffError | None = None

    def __call__(self) -> None:
        """Decode the body into its rows; never raises (``feed`` re-raises ``error``)."""
        try:
            self.decode(self.body)
        except HandoffError as exc:
            self.error = exc
        except Exception as exc:  # a plugin codec's own failure fails this handoff only
            self.error = CorruptChunk(f"codec failed on a landed chunk: {exc!r:.200}")
        self.done = True


def landing_for(codec: KVCodec, chunk: ChunkHeader, tensor: np.ndarray, spec: ArraySpec,
                memory: ReceiveMemory | None = None) -> LandedDecode | None:
    """A coded chunk's body buffer and decode; None where the body lands raw in its rows.

    The buffer is allocated before any byte arrives, so its size (the peer's
    claim) is bounded by what the chunk's rows hold raw: no codec of ours emits
    more, and rows are claimed once each, so a handoff's buffers stay within its budget.
    It comes from ``memory``'s pool where there is one (``ReceiveMemory.body``).
    """
    if not spec.coded or isinstance(codec, IdentityCodec) or not chunk.nbytes:
        return None
    raw_bytes = chunk.rows * spec.row_bytes
    if chunk.nbytes > raw_bytes + raw_bytes // 8 + _SLACK_BYTES:
        raise OversizeDeclared(f"{codec.name} chunk of {chunk.nbytes} bytes for "
                               f"{raw_bytes} raw bytes")
    buffer = (memory or ReceiveMemory()).body(chunk.nbytes)
    body = memoryview(buffer).cast("B")
    key = (chunk.layer, chunk.tensor, chunk.row)
    return LandedDecode(key, body, partial(_decode, codec, chunk, tensor, spec))


def _decode(codec: KVCodec, chunk: ChunkHeader, tensor: np.ndarray, spec: ArraySpec,
            body: memoryview) -> None:
    decode_chunk_into(codec, chunk, body, tensor, spec)
