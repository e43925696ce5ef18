"""One chunk's body into its layer's rows: decoded by the handoff's codec, or already there.

A raw (identity-codec) body that the link wrote straight into the layer buffer
(``KVAssembler.chunk_destination``) occupies its rows already: nothing to copy. A
buffer with room after each head's tokens (``layer_buffers.layer_buffers``) takes
a chunk's rows as per-head pieces.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from mlxcel_plugin.errors import HandoffError
from mlxcel_plugin.kv_codecs import CorruptChunk, KVCodec
from mlxcel_plugin.kv_codecs.scratch import scratch
from mlxcel_plugin.kv_serde.layer_spec import ArraySpec
from mlxcel_plugin.kv_serde.messages import ChunkHeader
from mlxcel_plugin.kv_serde.received_layer import row_segments
from mlxcel_plugin.link.protocol.body_parts import BodyParts


def decode_chunk_into(
    codec: KVCodec, chunk: ChunkHeader, body: Any, tensor: np.ndarray, spec: ArraySpec
) -> None:
    """Decode ``body`` and write it over the chunk's rows of ``tensor``.

    Arrays the codec may not touch (``spec.coded`` false) travel raw. A plugin
    codec's own failure, or an output of the wrong shape or dtype, raises
    ``CorruptChunk``: it fails this handoff only.
    """
    pieces = row_segments(tensor, chunk.row, chunk.rows)
    if len(pieces) == 1:  # rows of the [kv_heads * tokens, head_dim] view: one byte range
        _decode_rows(codec, chunk, body, pieces[0], spec)
        return
    if spec.coded and _decoded_into_pieces(codec, chunk, body, pieces, spec):
        return
    # A buffer with room: decoded whole, then copied per head. This thread's scratch, not a
    # fresh array: fresh pages fault on first touch (~2.7 s per GiB here).
    rows = scratch("chunk_body.rows", (chunk.rows, spec.width), tensor.dtype)
    _decode_rows(codec, chunk, body, rows, spec)
    at = 0
    for piece in pieces:
        piece[...] = rows[at : at + len(piece)]
        at += len(piece)


def _decoded_into_pieces(codec: KVCodec, chunk: ChunkHeader, body: Any,
                         pieces: list[np.ndarray], spec: ArraySpec) -> bool:
    """The codec's ``decode_into_pieces`` where it has one: each head's rows decoded where
    they belong, no copy; False where it has none or cannot cut this chunk there."""
    into = getattr(codec, "decode_into_pieces", None)
    if into is None:
        return False
    with _codec_failures(codec):
        return bool(into(body, chunk.codec_meta, pieces, spec.dtype))


@contextmanager
def _codec_failures(codec: KVCodec) -> Iterator[None]:
    """A plugin codec's own failure inside fails this handoff only (``CorruptChunk``)."""
    try:
        yield
    except HandoffError:
        raise
    except Exception as exc:
        raise CorruptChunk(f"codec {codec.name} failed: {exc!r:.200}") from exc


def _decode_rows(codec: KVCodec, chunk: ChunkHeader, body: Any, rows: np.ndarray,
                 spec: ArraySpec) -> None:
    shape = (chunk.rows, spec.width)
    if not spec.coded:
        if len(body) != chunk.rows * spec.row_bytes:
            raise CorruptChunk(f"raw chunk of {len(body)} bytes for {chunk.rows} rows")
        data = bytes(body) if isinstance(body, BodyParts) else body
        rows[...] = np.frombuffer(data, dtype=spec.storage).reshape(shape)
        return
    into = getattr(codec, "decode_into", None)
    with _codec_failures(codec):
        if into is not None:  # straight into the receive buffer (``KVCodec.decode``)
            into(body, chunk.codec_meta, rows, spec.dtype)
            return
        decoded = codec.decode(body, chunk.codec_meta, shape, spec.dtype)
    if not isinstance(decoded, np.ndarray) or decoded.shape != shape:
        raise CorruptChunk(f"codec {codec.name} returned the wrong shape")
    if decoded.dtype != rows.dtype:
        raise CorruptChunk(f"codec {codec.name} returned {decoded.dtype}, not {rows.dtype}")
    rows[...] = decoded


def occupies(body: Any, dest: memoryview | list[memoryview]) -> bool:
    """True when ``body`` already is ``dest``'s bytes (written in place): nothing to copy.

    ``dest`` may be pieces (a buffer with room, per head); a body the link scattered over
    them is a ``BodyParts`` of the same pieces.
    """
    dests = dest if isinstance(dest, list) else [dest]
    parts = body.views if isinstance(body, BodyParts) else (body,)
    if len(parts) != len(dests):
        return False
    return all(_same_bytes(part, view) for part, view in zip(parts, dests, strict=True))


def _same_bytes(body: Any, dest: memoryview) -> bool:
    if body is dest:  # the link scattered the body into the very views it was given
        return len(dest) > 0
    if len(body) != len(dest) or not len(dest):
        return False
    return _address(body) == _address(dest)


def _address(buffer: Any) -> int:
    """Where ``buffer``'s bytes start (ctypes for a writable one: ~0.2 µs, numpy's ~1.3)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    except (TypeError, BufferError):  # read-only, or not a buffer ctypes takes
        return np.frombuffer(buffer, dtype=np.uint8).ctypes.data
