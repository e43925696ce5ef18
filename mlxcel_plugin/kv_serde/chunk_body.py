"""One chunk's body into its layer's rows: decoded by the handoff's codec, or already there.

A raw (identity-codec) body that the link wrote straight into the layer buffer
(``KVAssembler.chunk_destination``) occupies its rows already: nothing to copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlxcel_plugin.errors import HandoffError
from mlxcel_plugin.kv_codecs import CorruptChunk, KVCodec
from mlxcel_plugin.kv_serde.layer_spec import ArraySpec
from mlxcel_plugin.kv_serde.messages import ChunkHeader


def decode_chunk_into(
    codec: KVCodec, chunk: ChunkHeader, body: Any, tensor: np.ndarray, spec: ArraySpec
) -> None:
    """Decode ``body`` and write it over the chunk's rows of ``tensor``.

    Arrays the codec may not touch (``spec.coded`` false) travel raw. A plugin
    codec's own failure, or an output of the wrong shape or dtype, raises
    ``CorruptChunk``: it fails this handoff only.
    """
    shape = (chunk.rows, spec.width)
    # Rows of the [kv_heads * tokens, head_dim] view are a contiguous byte range.
    rows = tensor.reshape(-1, spec.width)[chunk.row : chunk.row + chunk.rows]
    if not spec.coded:
        if len(body) != chunk.rows * spec.row_bytes:
            raise CorruptChunk(f"raw chunk of {len(body)} bytes for {chunk.rows} rows")
        rows[...] = np.frombuffer(body, dtype=spec.storage).reshape(shape)
        return
    into = getattr(codec, "decode_into", None)
    try:
        if into is not None:  # straight into the receive buffer (``KVCodec.decode``)
            into(body, chunk.codec_meta, rows, spec.dtype)
            return
        decoded = codec.decode(body, chunk.codec_meta, shape, spec.dtype)
    except HandoffError:
        raise
    except Exception as exc:  # a plugin codec's own failure fails this handoff only
        raise CorruptChunk(f"codec {codec.name} failed: {exc!r:.200}") from exc
    if not isinstance(decoded, np.ndarray) or decoded.shape != shape:
        raise CorruptChunk(f"codec {codec.name} returned the wrong shape")
    if decoded.dtype != tensor.dtype:
        raise CorruptChunk(f"codec {codec.name} returned {decoded.dtype}, not {tensor.dtype}")
    rows[...] = decoded


def occupies(body: Any, dest: memoryview) -> bool:
    """True when ``body`` already is ``dest``'s bytes (written in place): nothing to copy."""
    if len(body) != len(dest) or not len(dest):
        return False
    body_at = np.frombuffer(body, dtype=np.uint8).ctypes.data
    return body_at == np.frombuffer(dest, dtype=np.uint8).ctypes.data
