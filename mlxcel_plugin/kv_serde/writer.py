"""Sender side: a HandoffHeader and layers in, KVMessages out (no I/O, no timing)."""

from __future__ import annotations

import dataclasses

import numpy as np

from mlxcel_plugin.engine_api import CacheLayer
from mlxcel_plugin.kv_codecs import ChunkLayout, KVCodec, storage_dtype
from mlxcel_plugin.kv_codecs.base import raw_view
from mlxcel_plugin.kv_serde.delta import delta_layer
from mlxcel_plugin.kv_serde.errors import (
    FingerprintMismatch,
    LayerCountMismatch,
    MalformedHandoff,
    OversizeDeclared,
    TruncatedLayer,
    UnexpectedMessage,
    UnsupportedCacheKind,
)
from mlxcel_plugin.kv_serde.header import SUPPORTED_CACHE_KINDS, HandoffHeader
from mlxcel_plugin.kv_serde.messages import (
    TENSORS,
    ChunkHeader,
    EndHeader,
    KVMessage,
    LayerDescriptor,
)
from mlxcel_plugin.link.protocol.checksum import crc32

MIB = 1 << 20
RECORD_BYTES = 8 * MIB  # the link's plaintext record bound
# Room for the frame's type byte and msgpack header (a chunk header is < 1 KiB).
FRAME_HEADROOM_BYTES = 64 * 1024
DEFAULT_MAX_BODY_BYTES = RECORD_BYTES - FRAME_HEADROOM_BYTES
# As large as a record allows: every chunk costs both ends a frame's bookkeeping, and a
# tensor just over 4 MiB no longer leaves a small second chunk behind.
DEFAULT_CHUNK_BYTES = DEFAULT_MAX_BODY_BYTES


class KVWriter:
    """Encodes one handoff: ``begin()``, ``layer(i, layer)`` per layer (any order), ``end()``.

    Chunks hold at most ``chunk_bytes`` of raw tensor bytes (at least one row).
    The end message carries a crc32 per layer tensor over the bytes the
    receiver will hold — for a lossy codec, the sender decodes its own output.
    A delta header (``prefix_tokens``) makes every layer ship only the
    positions after the prefix: give it whole layers, it slices them.
    """

    def __init__(
        self,
        header: HandoffHeader,
        codec: KVCodec,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ):
        header.fingerprint.check_supported()
        self.header = dataclasses.replace(header, codec=codec.name)
        self.codec = codec
        self.chunk_bytes = chunk_bytes
        self.max_body_bytes = max_body_bytes
        self.chunks = 0
        self.raw_bytes = 0
        self.encoded_bytes = 0
        self._checksums: dict[int, tuple[int, int]] = {}

    def begin(self) -> KVMessage:
        return self.header.to_message()

    def layer(self, index: int, layer: CacheLayer) -> list[KVMessage]:
        layer = delta_layer(layer, self.header, index)
        self._check_layer(index, layer)
        descriptor = LayerDescriptor(layer.keys.shape[2], layer.offset, dict(layer.meta))
        messages: list[KVMessage] = []
        crcs = []
        for tensor, array in zip(TENSORS, (layer.keys, layer.values), strict=True):
            crcs.append(self._encode_tensor(index, tensor, array, descriptor, messages))
        self._checksums[index] = (crcs[0], crcs[1])
        return messages

    def end(self) -> KVMessage:
        layers = self.header.fingerprint.num_layers
        missing = [i for i in range(layers) if i not in self._checksums]
        if missing:
            raise TruncatedLayer(f"handoff ends without layers {missing[:8]}")
        end = EndHeader(
            handoff_id=self.header.handoff_id,
            epoch=self.header.epoch,
            chunks=self.chunks,
            num_layers=layers,
            checksums=tuple(self._checksums[i] for i in range(layers)),
        )
        return KVMessage("end", end.to_dict())

    def _check_layer(self, index: int, layer: CacheLayer) -> None:
        fp = self.header.fingerprint
        if not 0 <= index < fp.num_layers:
            raise LayerCountMismatch(f"layer {index} out of range for {fp.num_layers} layers")
        if index in self._checksums:
            raise UnexpectedMessage(f"layer {index} was already sent")
        if layer.kind not in SUPPORTED_CACHE_KINDS or layer.kind != fp.cache_classes[index]:
            raise UnsupportedCacheKind(f"layer {index} is a {layer.kind}, not sendable as such")
        if layer.dtype != fp.dtype:
            raise FingerprintMismatch(f"layer {index} dtype {layer.dtype} != model {fp.dtype}")
        tokens = layer.keys.shape[2] if layer.keys.ndim == 4 else -1
        want = (1, fp.kv_heads, tokens, fp.head_dim)
        for array in (layer.keys, layer.values):
            if array.shape != want or array.dtype != storage_dtype(fp.dtype):
                raise FingerprintMismatch(
                    f"layer {index} tensor {array.shape}/{array.dtype} does not match {want}"
                )
        if not 1 <= tokens <= layer.offset <= self.header.prompt_length:
            raise MalformedHandoff(
                f"layer {index}: tokens {tokens}, offset {layer.offset}, "
                f"prompt_length {self.header.prompt_length} are inconsistent"
            )

    def _encode_tensor(
        self,
        index: int,
        tensor: str,
        array: np.ndarray,
        descriptor: LayerDescriptor,
        out: list[KVMessage],
    ) -> int:
        fp = self.header.fingerprint
        rows = np.ascontiguousarray(array).reshape(-1, fp.head_dim)
        step = max(1, self.chunk_bytes // fp.row_bytes)
        crc = 0
        for row in range(0, rows.shape[0], step):
            part = rows[row : row + step]
            layout = ChunkLayout(tensor, descriptor.tokens, row)
            body, meta = self.codec.encode(part, fp.dtype, layout)
            if len(body) > self.max_body_bytes:
                raise OversizeDeclared(
                    f"{self.codec.name} chunk of {len(body)} bytes exceeds {self.max_body_bytes}"
                )
            crc = crc32(self._held_bytes(part, body, meta), crc)
            header = ChunkHeader(
                self.header.handoff_id,
                self.header.epoch,
                index,
                tensor,
                row,
                part.shape[0],
                len(body),
                descriptor,
                meta,
            )
            out.append(KVMessage("chunk", header.to_dict(), body))
            self.chunks += 1
            self.raw_bytes += part.nbytes
            self.encoded_bytes += len(body)
        return crc

    def _held_bytes(self, part: np.ndarray, body, meta) -> memoryview:
        """The bytes the receiver will hold for this chunk."""
        if self.codec.lossless:
            return raw_view(part)
        decoded = self.codec.decode(body, meta, part.shape, self.header.fingerprint.dtype)
        return raw_view(decoded)
