"""Sender side: a HandoffHeader and layers in, KVMessages out (no I/O, no timing)."""

from __future__ import annotations

import dataclasses

import numpy as np

from mlxcel_plugin.engine_api import CacheLayer
from mlxcel_plugin.kv_codecs import ChunkLayout, KVCodec
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
from mlxcel_plugin.kv_serde.header import (
    CHECKSUM_OF_ENCODED,
    SUPPORTED_CACHE_KINDS,
    HandoffHeader,
)
from mlxcel_plugin.kv_serde.layer_spec import ArraySpec, LayerSpec
from mlxcel_plugin.kv_serde.messages import (
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
    A layer ships the arrays its ``LayerSpec`` names, in that order; arrays the
    spec does not mark ``coded`` go raw whatever the codec. The end message
    carries a crc32 per layer array over the bytes the receiver will hold —
    for a lossy codec, the sender decodes its own output.
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
        self._crc_of_bodies = header.checksum_of == CHECKSUM_OF_ENCODED

    def begin(self) -> KVMessage:
        return self.header.to_message()

    def layer(self, index: int, layer: CacheLayer) -> list[KVMessage]:
        layer = delta_layer(layer, self.header, index)
        tokens = self._check_layer(index, layer)
        descriptor = LayerDescriptor(tokens, layer.offset, dict(layer.meta))
        messages: list[KVMessage] = []
        crcs = []
        for spec in self.header.fingerprint.layers[index].arrays:
            array = layer.array(spec.name)
            crcs.append(self._encode_tensor(index, spec, array, descriptor, messages))
        self._checksums[index] = tuple(crcs)
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

    def _check_layer(self, index: int, layer: CacheLayer) -> int:
        """Refuse a layer that does not fit its spec; returns the tokens it holds."""
        fp = self.header.fingerprint
        if not 0 <= index < fp.num_layers:
            raise LayerCountMismatch(f"layer {index} out of range for {fp.num_layers} layers")
        if index in self._checksums:
            raise UnexpectedMessage(f"layer {index} was already sent")
        if layer.kind not in SUPPORTED_CACHE_KINDS or layer.kind != fp.cache_classes[index]:
            raise UnsupportedCacheKind(f"layer {index} is a {layer.kind}, not sendable as such")
        if layer.keys is not None and layer.dtype != fp.dtype:  # SSM state: per-array dtypes
            raise FingerprintMismatch(f"layer {index} dtype {layer.dtype} != model {fp.dtype}")
        spec = fp.layers[index]
        tokens = _held_tokens(spec, layer)
        for array_spec in spec.arrays:
            array, want = layer.array(array_spec.name), array_spec.shape_for(tokens)
            if array is None or array.shape != want or array.dtype != array_spec.storage:
                got = "none" if array is None else f"{array.shape}/{array.dtype}"
                raise FingerprintMismatch(
                    f"layer {index} {array_spec.name} tensor {got} does not match {want}"
                )
        if not 1 <= tokens <= layer.offset <= self.header.prompt_length:
            raise MalformedHandoff(
                f"layer {index}: tokens {tokens}, offset {layer.offset}, "
                f"prompt_length {self.header.prompt_length} are inconsistent"
            )
        return tokens

    def _encode_tensor(
        self,
        index: int,
        spec: ArraySpec,
        array: np.ndarray,
        descriptor: LayerDescriptor,
        out: list[KVMessage],
    ) -> int:
        tensor = spec.name
        rows = np.ascontiguousarray(array).reshape(-1, spec.width)
        step = max(1, self.chunk_bytes // spec.row_bytes)
        crc = 0
        for row in range(0, rows.shape[0], step):
            part = rows[row : row + step]
            layout = ChunkLayout(tensor, descriptor.tokens, row)
            body, meta = (self.codec.encode(part, spec.dtype, layout) if spec.coded
                          else (raw_view(part), {}))
            if len(body) > self.max_body_bytes:
                raise OversizeDeclared(
                    f"{self.codec.name} chunk of {len(body)} bytes exceeds {self.max_body_bytes}"
                )
            over_body = not spec.coded or self._crc_of_bodies
            crc = crc32(body if over_body else self._held_bytes(part, body, meta), crc)
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


def _held_tokens(spec: LayerSpec, layer: CacheLayer) -> int:
    """Positions a layer's growing arrays hold (1 for a fixed-size state: it has none)."""
    for array_spec in spec.arrays:
        array = layer.array(array_spec.name)
        axis = array_spec.grow_axis
        if axis is not None and array is not None:
            return int(array.shape[axis]) if array.ndim > axis else -1
    return 1
