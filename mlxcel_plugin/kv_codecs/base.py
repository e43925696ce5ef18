"""What a KV codec is: the interface, wire dtypes, nominal profile, errors.

A codec turns one chunk of a K or V tensor (a C-contiguous ``[rows, head_dim]``
array; bfloat16 as a ``uint16`` view) into bytes plus a small msgpack-able
``meta`` dict, and back. The sender says where the chunk sits (``ChunkLayout``:
K or V, tokens per head, first row), so a codec may group values along tokens;
``decode`` gets no layout: whatever it needs must travel in ``meta``. Chunks are
independent: a receiver decodes them in any order. ``decode`` must never
allocate more than the declared shape needs, and must refuse bad input with
``CorruptChunk`` (never another exception type).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from mlxcel_plugin.errors import HandoffError

Buffer = bytes | bytearray | memoryview

# Logical dtype name -> storage dtype on the wire (little-endian; bf16 is its raw bits).
WIRE_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    # Only for the inner stages of a chained codec (bytes in, bytes out).
    "uint8": np.dtype("u1"),
}
TENSOR_DTYPES = ("float32", "float16", "bfloat16")


class CodecError(HandoffError):
    """A codec could not encode or decode a chunk."""

    code = "handoff_codec_error"


class UnknownCodec(CodecError):
    """The handoff names a codec this node has not registered."""

    code = "handoff_unknown_codec"


class CorruptChunk(CodecError):
    """A chunk body does not decode to the declared shape."""

    code = "handoff_corrupt_chunk"


@dataclass(frozen=True)
class ChunkLayout:
    """Where a chunk's rows sit in its layer tensor, seen as ``[kv_heads * tokens, head_dim]``.

    Rows are head-major: row ``i`` of the tensor is token ``i % tokens`` of
    head ``i // tokens``, so a chunk may start mid-head and span several heads.
    """

    tensor: str  # "k" or "v"
    tokens: int  # tokens per head in this layer
    first_row: int  # the chunk's first row in the tensor

    @property
    def first_token(self) -> int:
        return self.first_row % self.tokens


@dataclass(frozen=True)
class CodecProfile:
    """Nominal figures the AdaptiveSelector plans with.

    Measured on synthetic fp16 KV by ``loadtests/bench_kv_codecs.py``; they only
    need to rank codecs, not predict exact times.
    """

    ratio: float = 1.0  # raw bytes / encoded bytes
    encode_bytes_per_s: float = math.inf
    decode_bytes_per_s: float = math.inf
    # Bound on |x - decoded| relative to the max |x| of the element's group; a
    # group lies along a row or a column of the chunk (0 for lossless).
    relative_error: float = 0.0


@runtime_checkable
class KVCodec(Protocol):
    name: str
    lossless: bool
    profile: CodecProfile

    def encode(
        self, array: np.ndarray, dtype: str, layout: ChunkLayout | None = None
    ) -> tuple[Buffer, dict[str, Any]]:
        """Encode a C-contiguous chunk whose logical dtype is ``dtype``.

        ``layout`` is None where the chunk is not a K/V tensor slice (the inner
        stages of a chain see bytes); a codec must then encode without it.
        """
        ...

    def decode(
        self, data: Buffer, meta: Mapping[str, Any], shape: tuple[int, ...], dtype: str
    ) -> np.ndarray:
        """Return an array of ``shape`` in the storage dtype of ``dtype``.

        A codec may also offer ``decode_into(data, meta, out, dtype)``, writing the rows
        into ``out`` (a C-contiguous ``[rows, width]`` array of the storage dtype, the
        receive buffer itself): the receiver then uses it instead, saving a copy. And
        ``decode_into_pieces(data, meta, pieces, dtype) -> bool``: the rows in several such
        arrays back to back (a buffer with room: one per head), False (nothing written)
        where it cannot; without it those rows are decoded into scratch and copied.

        Decodes run on the receiving link's bulk thread as each chunk lands, several
        at once (one per lane), each into rows of its own: a codec must be safe to
        call from several threads, and gains from numpy/BLAS work that frees the GIL.
        """
        ...


def storage_dtype(dtype: str) -> np.dtype:
    if dtype not in WIRE_DTYPES:
        raise CodecError(f"unsupported dtype {dtype!r}; known: {', '.join(WIRE_DTYPES)}")
    return WIRE_DTYPES[dtype]


def expected_nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * storage_dtype(dtype).itemsize


def raw_view(array: np.ndarray) -> memoryview:
    """The array's bytes without a copy (one copy only when it is not contiguous)."""
    return memoryview(np.ascontiguousarray(array)).cast("B")


def frombuffer_checked(data: Buffer, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """View ``data`` as ``shape``/``dtype``, refusing a body of the wrong length."""
    want = expected_nbytes(shape, dtype)
    if len(data) != want:
        raise CorruptChunk(f"chunk body is {len(data)} bytes, expected {want}")
    return np.frombuffer(data, dtype=storage_dtype(dtype)).reshape(shape)


def meta_int(meta: Mapping[str, Any], key: str, lo: int, hi: int) -> int:
    value = meta.get(key) if isinstance(meta, Mapping) else None
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise CorruptChunk(f"codec meta {key!r} must be an int in [{lo}, {hi}], got {value!r}")
    return value


def meta_bool(meta: Mapping[str, Any], key: str) -> bool:
    value = meta.get(key) if isinstance(meta, Mapping) else None
    if not isinstance(value, bool):
        raise CorruptChunk(f"codec meta {key!r} must be a bool, got {value!r}")
    return value
