"""Sender side: a HandoffHeader and layers in, KVMessages out (no I/O, no timing)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

from mlxcel_plugin.engine_api import CacheLayer
from mlxcel_plugin.kv_codecs import ChunkLayout, KVCodec
from mlxcel_plugin.kv_codecs.base import raw_view
from mlxcel_plugin.kv_serde.delta import delta_layer
from mlxcel_plugin.kv_serde.early_rows import EarlyRows, can_send_early, head_runs
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
    IDENTITY_CODEC,
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
    for a lossy codec, the sender decodes its own output — or, for
    ``checksum_of = "none"`` (raw bodies, which AES-GCM authenticates), zeros:
    no pass over the bytes.
    A delta header (``prefix_tokens``) makes every layer ship only the
    positions after the prefix: give it whole layers, it slices them.
    ``rows(i, first_token, arrays)`` sends a cell's rows of a plain KVCache layer
    before the layer is whole; the layer then sends only the rest (``early_rows``).
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
        self._early: dict[int, EarlyRows] = {}  # layers some of whose rows went ahead
        self._crc_of_bodies = header.checksum_of == CHECKSUM_OF_ENCODED
        self._checksummed = header.checksummed
        if not self._checksummed and codec.name != IDENTITY_CODEC:
            raise MalformedHandoff(f"checksum_of 'none' with codec {codec.name!r}: a codec "
                                   "that transforms the bytes keeps its digest")

    def begin(self) -> KVMessage:
        return self.header.to_message()

    def layer(self, index: int, layer: CacheLayer) -> list[KVMessage]:
        layer = delta_layer(layer, self.header, index)
        tokens = self._check_layer(index, layer)
        descriptor = LayerDescriptor(tokens, layer.offset, dict(layer.meta))
        messages: list[KVMessage] = []
        early = self._early.pop(index, None)
        if early is not None:
            early.check_layer(index, descriptor)
            self._checksums[index] = self._rest_of_layer(index, layer, early, messages)
            return messages
        crcs = []
        for spec in self.header.fingerprint.layers[index].arrays:
            running = _RunningCrc()
            for row, rows in row_runs(layer.array(spec.name), spec.width, tokens):
                self._encode_rows(index, spec, rows, row, descriptor, messages, running)
            crcs.append(running.value)
        self._checksums[index] = tuple(crcs)
        return messages

    def rows(self, index: int, first_token: int, arrays: Mapping[str, np.ndarray]
             ) -> list[KVMessage]:
        """Layer ``index``'s K/V for tokens ``[first_token, first_token + n)`` (``arrays``:
        ``[1, kv_heads, n, head_dim]`` each) ahead of the layer; [] where it cannot take them."""
        if index in self._checksums:
            raise UnexpectedMessage(f"rows for layer {index}, which was already sent")
        layers = self.header.fingerprint.num_layers
        if not 0 <= index < layers:
            raise LayerCountMismatch(f"rows for layer {index} of {layers}")
        if not can_send_early(self.header, index):
            return []
        early = self._early.get(index) or EarlyRows.for_layer(self.header)
        specs = self.header.fingerprint.layers[index].arrays
        count = arrays["k"].shape[2] if arrays.get("k") is not None else -1
        _check_arrays(index, specs, arrays.get, count, "rows")
        span = early.take(first_token, first_token + count, self.header.prefix_tokens)
        if span is None:  # all within the receiver's prefix
            return []
        self._early[index] = early
        skip = span[0] + self.header.prefix_tokens - first_token
        messages: list[KVMessage] = []
        for spec in specs:
            part = arrays[spec.name][:, :, skip : skip + span[1] - span[0]]
            for row, run in head_runs(part, early.descriptor.tokens, span[0]):
                self._encode_rows(index, spec, run, row, early.descriptor, messages,
                                  _Recorder(early, spec.name))
        return messages

    def _rest_of_layer(self, index: int, layer: CacheLayer, early: EarlyRows,
                       messages: list[KVMessage]) -> tuple[int, ...]:
        """The rows of a layer not sent ahead; its checksums, combined over every chunk."""
        tokens, sent = early.descriptor.tokens, early.tokens_sent
        specs = self.header.fingerprint.layers[index].arrays
        for spec in specs if tokens > sent else ():
            for row, run in head_runs(layer.array(spec.name)[:, :, sent:], tokens, sent):
                self._encode_rows(index, spec, np.ascontiguousarray(run), row,
                                  early.descriptor, messages, _Recorder(early, spec.name))
        return tuple(early.crc(spec.name) for spec in specs)

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
        _check_arrays(index, spec.arrays, layer.array, tokens, "tensor")
        if not 1 <= tokens <= layer.offset <= self.header.prompt_length:
            raise MalformedHandoff(
                f"layer {index}: tokens {tokens}, offset {layer.offset}, "
                f"prompt_length {self.header.prompt_length} are inconsistent"
            )
        return tokens

    def _encode_rows(
        self,
        index: int,
        spec: ArraySpec,
        rows: np.ndarray,
        first_row: int,
        descriptor: LayerDescriptor,
        out: list[KVMessage],
        counted: Callable[[int, object], None],
    ) -> None:
        """Chunks of ``rows`` (``[n, width]``, from layer row ``first_row``) into ``out``;
        ``counted(row, bytes)`` gets what each chunk's checksum covers."""
        tensor = spec.name
        step = _whole_heads(max(1, self.chunk_bytes // spec.row_bytes), descriptor.tokens,
                            first_row)
        for at in range(0, rows.shape[0], step):
            part, row = rows[at : at + step], first_row + at
            layout = ChunkLayout(tensor, descriptor.tokens, row)
            body, meta = (self.codec.encode(part, spec.dtype, layout) if spec.coded
                          else (raw_view(part), {}))
            if len(body) > self.max_body_bytes:
                raise OversizeDeclared(
                    f"{self.codec.name} chunk of {len(body)} bytes exceeds {self.max_body_bytes}"
                )
            over_body = not spec.coded or self._crc_of_bodies
            if self._checksummed:
                counted(row, body if over_body else self._held_bytes(part, body, meta))
            header = ChunkHeader(self.header.handoff_id, self.header.epoch, index, tensor, row,
                                 part.shape[0], len(body), descriptor, meta)
            out.append(KVMessage("chunk", header.to_dict(), body))
            self.chunks += 1
            self.raw_bytes += part.nbytes
            self.encoded_bytes += len(body)

    def _held_bytes(self, part: np.ndarray, body, meta) -> memoryview:
        """The bytes the receiver will hold for this chunk."""
        if self.codec.lossless:
            return raw_view(part)
        decoded = self.codec.decode(body, meta, part.shape, self.header.fingerprint.dtype)
        return raw_view(decoded)


class _RunningCrc:
    """crc32 of the byte runs fed to it, in order (a layer sent whole)."""

    def __init__(self) -> None:
        self.value = 0

    def __call__(self, _row: int, data) -> None:
        self.value = crc32(data, self.value)


class _Recorder:
    """Keeps each chunk's crc32 by row, to combine in row order (rows sent ahead)."""

    def __init__(self, early: EarlyRows, tensor: str):
        self.early, self.tensor = early, tensor

    def __call__(self, row: int, data) -> None:
        self.early.record(self.tensor, row, crc32(data), len(data))


def _check_arrays(index: int, specs, array_of: Callable[[str], np.ndarray | None],
                  tokens: int, what: str) -> None:
    """Refuse arrays (a whole layer's or rows sent ahead) unlike their spec at ``tokens``."""
    for spec in specs:
        array, want = array_of(spec.name), spec.shape_for(tokens)
        if array is None or array.shape != want or array.dtype != spec.storage:
            got = "none" if array is None else f"{array.shape}/{array.dtype}"
            raise FingerprintMismatch(f"layer {index} {spec.name} {what} {got} does not match "
                                      f"{want}")


def _whole_heads(step: int, tokens: int, first_row: int) -> int:
    """``step`` rows, fewer where that ends every chunk on a head's last row.

    Why: a decode node lands each head's rows in a piece of its own (its buffer has
    decode room after each head), and a bulk record that spans two pieces is opened
    in parts, which costs more than one record into one piece; chunks of whole heads
    keep each record inside one head wherever a head is a whole number of records.
    """
    if tokens <= 0 or step < tokens or first_row % tokens:
        return step
    return step - step % tokens


def row_runs(array: np.ndarray, width: int, tokens: int) -> list[tuple[int, np.ndarray]]:
    """(first layer row, ``[n, width]`` rows) covering ``array`` in row order, without copying.

    A K/V tensor viewed over the engine's own cache buffer (``[1, heads, tokens,
    width]`` cut from a longer buffer) is contiguous head by head, not as a whole:
    it goes out one head's run at a time. Other layouts are made contiguous once.
    """
    if array.flags.c_contiguous:
        return [(0, array.reshape(-1, width))]
    if array.ndim == 4 and array.shape[0] == 1 and array[0, 0].flags.c_contiguous:
        return head_runs(array, tokens, 0)
    return [(0, np.ascontiguousarray(array).reshape(-1, width))]


def _held_tokens(spec: LayerSpec, layer: CacheLayer) -> int:
    """Positions a layer's growing arrays hold (1 for a fixed-size state: it has none)."""
    for array_spec in spec.arrays:
        array = layer.array(array_spec.name)
        axis = array_spec.grow_axis
        if axis is not None and array is not None:
            return int(array.shape[axis]) if array.ndim > axis else -1
    return 1
