"""KVMessage and the KV_CHUNK / KV_END / KV_ACK headers.

The node maps ``KVMessage.kind`` onto a frame type (begin → KV_BEGIN, ...),
``header`` onto the frame's msgpack map and ``body`` onto its raw body, and
sends it on link ``lane``. Header maps hold only msgpack types.

A chunk is rows ``[row, row + rows)`` of one array of a layer (K, V, or
any array its ``LayerSpec`` names) viewed as a C-contiguous
``[rows, shape[-1]]`` matrix (for K/V: ``[kv_heads * tokens, head_dim]``):
a byte range of the array, so the sender slices without copying and the receiver can place
chunks in any order. Each chunk repeats its layer's descriptor (tokens,
offset, layer_meta) so layers need no separate message and Streamed can
begin before any layer shape is known.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from mlxcel_plugin.kv_codecs import Buffer
from mlxcel_plugin.kv_serde import fields as f
from mlxcel_plugin.kv_serde.errors import MalformedHandoff
from mlxcel_plugin.kv_serde.fields import MAX_LAYERS, MAX_TOKENS
from mlxcel_plugin.kv_serde.layer_spec import MAX_ARRAYS

MessageKind = Literal["begin", "chunk", "end", "ack"]
TENSORS = ("k", "v")
CHECKSUM_ALGO = "crc32"


@dataclass(frozen=True)
class KVMessage:
    kind: MessageKind
    header: dict[str, Any]
    body: Buffer = b""
    lane: int = 0  # which link carries it (LayerParallel); 0 for single-link strategies
    # Receiving: the body's crc32 as the link took it while decrypting it in place (else None).
    body_crc: int | None = None


@dataclass(frozen=True)
class LayerDescriptor:
    """One layer's shape beyond the fingerprint: tokens held, mlx-lm offset, cache meta."""

    tokens: int
    offset: int
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ChunkHeader:
    handoff_id: str
    epoch: int
    layer: int
    tensor: str  # the array's name in its LayerSpec ("k", "v", "s0", ...)
    row: int
    rows: int
    nbytes: int  # body length, so a short body is told apart from a bad one
    descriptor: LayerDescriptor
    codec_meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "handoff_id": self.handoff_id,
            "epoch": self.epoch,
            "layer": self.layer,
            "tensor": self.tensor,
            "row": self.row,
            "rows": self.rows,
            "nbytes": self.nbytes,
            "tokens": self.descriptor.tokens,
            "offset": self.descriptor.offset,
            "layer_meta": self.descriptor.meta,
            "codec_meta": self.codec_meta,
        }

    @classmethod
    def from_dict(cls, data: Any) -> ChunkHeader:
        data = f.as_map(data, "chunk header")
        tensor = f.get_str(data, "tensor", 32)  # the assembler checks it against the layer
        codec_meta = f.as_map(data.get("codec_meta", {}), "codec_meta")
        return cls(
            handoff_id=f.get_str(data, "handoff_id"),
            epoch=f.get_int(data, "epoch"),
            layer=f.get_int(data, "layer", 0, MAX_LAYERS - 1),
            tensor=tensor,
            row=f.get_int(data, "row"),
            rows=f.get_int(data, "rows", 1),
            nbytes=f.get_int(data, "nbytes"),
            descriptor=LayerDescriptor(
                tokens=f.get_int(data, "tokens", 1, MAX_TOKENS),
                offset=f.get_int(data, "offset", 1, MAX_TOKENS),
                meta=f.get_scalar_map(data, "layer_meta"),
            ),
            codec_meta=dict(codec_meta),
        )


@dataclass(frozen=True)
class EndHeader:
    """``chunks`` lets the receiver tell "still arriving on another lane" from "truncated"."""

    handoff_id: str
    epoch: int
    chunks: int
    num_layers: int
    checksums: tuple[tuple[int, ...], ...]  # per layer: crc32 of each array, in spec order
    checksum_algo: str = CHECKSUM_ALGO

    def to_dict(self) -> dict[str, Any]:
        return {
            "handoff_id": self.handoff_id,
            "epoch": self.epoch,
            "chunks": self.chunks,
            "num_layers": self.num_layers,
            "checksum_algo": self.checksum_algo,
            "checksums": [list(pair) for pair in self.checksums],
        }

    @classmethod
    def from_dict(cls, data: Any) -> EndHeader:
        data = f.as_map(data, "end header")
        if data.get("checksum_algo") != CHECKSUM_ALGO:
            raise MalformedHandoff(f"checksum_algo must be {CHECKSUM_ALGO!r}")
        num_layers = f.get_int(data, "num_layers", 1, MAX_LAYERS)
        raw = data.get("checksums")
        if not isinstance(raw, list | tuple) or len(raw) != num_layers:
            raise MalformedHandoff("checksums must list one entry per layer")
        pairs = tuple(f.as_int_list(c, "checksum entry", MAX_ARRAYS, 0, 2**32 - 1) for c in raw)
        if any(not pair for pair in pairs):
            raise MalformedHandoff("each checksum entry lists one crc32 per array")
        return cls(
            handoff_id=f.get_str(data, "handoff_id"),
            epoch=f.get_int(data, "epoch"),
            chunks=f.get_int(data, "chunks", 1),
            num_layers=num_layers,
            checksums=pairs,  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class AckHeader:
    """KV_ACK: decode → prefill. ``ok`` frees the sender's copy; else ``error_code`` says why."""

    request_id: str
    handoff_id: str
    epoch: int
    ok: bool
    error_code: str | None = None
    error: str | None = None
    # How busy the decode node's bulk readers were while they read this handoff (0..1;
    # None: unmeasured, or a peer that predates it). Near 1 the receiver, not the link,
    # set the pace, and the sender's bandwidth sample is only a floor (link/read_load.py).
    reader_busy_share: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "handoff_id": self.handoff_id,
            "epoch": self.epoch,
            "ok": self.ok,
            "error_code": self.error_code,
            "error": self.error,
            "reader_busy_share": self.reader_busy_share,
        }

    @classmethod
    def from_dict(cls, data: Any) -> AckHeader:
        data = f.as_map(data, "ack header")
        return cls(
            request_id=f.get_str(data, "request_id"),
            handoff_id=f.get_str(data, "handoff_id"),
            epoch=f.get_int(data, "epoch"),
            ok=f.get_bool(data, "ok"),
            error_code=f.get_optional_str(data, "error_code"),
            error=f.get_optional_str(data, "error", 2048),
            reader_busy_share=f.get_optional_float(data, "reader_busy_share", 0.0, 1.0),
        )


def make_ack(
    request_id: str, handoff_id: str, epoch: int, error: Exception | None = None,
    reader_busy_share: float | None = None,
) -> KVMessage:
    """The ack for a handoff: ok (with how busy its readers were), or the refusal's code
    and message."""
    if error is None:
        return KVMessage("ack", AckHeader(request_id, handoff_id, epoch, ok=True,
                                          reader_busy_share=reader_busy_share).to_dict())
    code = getattr(error, "code", None) or "handoff_failed"
    text = str(error)[:2048] or code
    return KVMessage("ack", AckHeader(request_id, handoff_id, epoch, False, code, text).to_dict())
