"""Receiver side: KVMessages in (chunks in any order), a CacheState out.

Every check that bounds memory runs before the allocation it guards: the begin
is refused unless the whole cache it implies fits ``max_bytes``; a layer's
buffers are allocated at the begin where it implies the layer's shape
(``expected_layers``), else on its first chunk, once its descriptor is checked.

The I/O layer may ask ``chunk_destination`` where a raw chunk's bytes belong
and have the link decrypt the body there (handing over its crc32, taken as it
landed: ``KVMessage.body_crc``); a coded chunk gets a buffer and its decode,
run on the link's thread as it lands (``landing``). Each tensor's crc32 is
known once its last row lands, and each whole layer goes to the engine's
adopter (e.g. MLX arrays) at once: both overlap the rest of the transfer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from mlxcel_plugin.engine_api import CacheState, LayerAdopter
from mlxcel_plugin.errors import HandoffError
from mlxcel_plugin.kv_codecs import KVCodec, resolve_codec
from mlxcel_plugin.kv_serde.chunk_body import decode_chunk_into, occupies
from mlxcel_plugin.kv_serde.delta import check_delta_begin, check_delta_layer
from mlxcel_plugin.kv_serde.errors import (
    ChecksumMismatch,
    LayerCountMismatch,
    MalformedHandoff,
    OversizeDeclared,
    RequestMismatch,
    StaleEpoch,
    TruncatedLayer,
    UnexpectedMessage,
)
from mlxcel_plugin.kv_serde.expected_layers import expected_layers
from mlxcel_plugin.kv_serde.header import CHECKSUM_OF_ENCODED, HandoffHeader, ModelFingerprint
from mlxcel_plugin.kv_serde.landing import ChunkKey, LandedDecode, landing_for
from mlxcel_plugin.kv_serde.layer_buffers import LayerStock, layer_allocation
from mlxcel_plugin.kv_serde.layer_spec import ArraySpec
from mlxcel_plugin.kv_serde.limits import AssemblerLimits
from mlxcel_plugin.kv_serde.messages import ChunkHeader, EndHeader, KVMessage, LayerDescriptor
from mlxcel_plugin.kv_serde.receive_memory import ReceiveMemory
from mlxcel_plugin.kv_serde.received_layer import ReceivedLayer
from mlxcel_plugin.kv_serde.state import SerializableCacheState


class KVAssembler:
    """One handoff's receiving state machine: ``feed`` each message; the last returns the cache.

    States: waiting for begin → receiving → done (or failed: the first refusal
    is final). A duplicate begin identical to the first is accepted — the
    LayerParallel strategy sends one per lane so each lane's chunks follow a
    begin on that lane. ``end`` may arrive before chunks from other lanes.
    """

    def __init__(self, local: ModelFingerprint, codecs: Mapping[str, KVCodec],
                 limits: AssemblerLimits | None = None, *, min_epoch: int = 0,
                 expected_request_id: str | None = None, memory: ReceiveMemory | None = None,
                 adopt: LayerAdopter | None = None):
        self.local = local
        self.codecs = codecs
        self.limits = limits or AssemblerLimits()
        self.min_epoch = min_epoch
        self.expected_request_id = expected_request_id
        self.memory = memory or ReceiveMemory()
        self._stock = LayerStock(self.memory)  # later layers' buffers, taken with the first
        self.adopt = adopt
        self.header: HandoffHeader | None = None
        self.allocated_bytes = 0
        self.received_chunks = 0
        self.received_bytes = 0
        self._codec: KVCodec | None = None
        self._layers: dict[int, ReceivedLayer] = {}
        self._expected: dict[int, int] = {}  # index -> bytes, of layers readied at the begin
        self._landing: dict[ChunkKey, LandedDecode] = {}  # coded chunks decoded where they land
        # id(raw header) -> (raw, checked ChunkHeader, its rows' views; None: coded) of chunks
        # given a destination (rows claimed): feed takes them for the same header object.
        self._placed: dict[int, tuple[Any, ChunkHeader, list[memoryview] | None]] = {}
        self._end: EndHeader | None = None
        self._state = "waiting"

    @property
    def done(self) -> bool:
        return self._state == "done"

    def feed(self, message: KVMessage) -> SerializableCacheState | None:
        """Apply one message; returns the assembled handoff once it is complete and verified."""
        if self._state == "failed":
            raise UnexpectedMessage("this handoff already failed")
        return self._failing_on_refusal(self._dispatch, message)

    def begin(self, header: HandoffHeader) -> None:
        """``feed`` of the begin ``header`` came from, parsed once by a receiver admitting it."""
        if self._state != "waiting":
            raise UnexpectedMessage(f"a begin for a handoff already {self._state}")
        self._failing_on_refusal(self._start, header)

    def _failing_on_refusal(self, step: Callable[[Any], Any], arg: Any) -> Any:
        """``step(arg)``; a refusal is final: the handoff fails and its buffers go."""
        try:
            return step(arg)
        except HandoffError:
            self._fail()
            raise

    def progress(self) -> dict[str, Any]:
        """What has arrived and what is missing (for timeouts and logs)."""
        return {
            "state": self._state,
            "handoff_id": self.header.handoff_id if self.header else None,
            "received_chunks": self.received_chunks,
            "expected_chunks": self._end.chunks if self._end else None,
            "received_bytes": self.received_bytes,
            "allocated_bytes": self.allocated_bytes,
            "layers_started": len(self._layers),
        }

    def expire(self) -> None:
        """Give up (transfer timeout): raise TruncatedLayer naming what is missing, free buffers."""
        missing = [i for i in range(self.local.num_layers)
                   if i not in self._layers or not self._layers[i].complete]
        progress = self.progress()
        self._fail()
        raise TruncatedLayer(f"handoff timed out; incomplete layers {missing[:16]}; {progress}")

    def _dispatch(self, message: KVMessage) -> SerializableCacheState | None:
        if self._state == "done":
            if message.kind == "begin" and self._same_begin(message):
                return None
            raise UnexpectedMessage(f"{message.kind!r} after the handoff completed")
        if message.kind == "begin":
            self._on_begin(message)
            return None
        if self._state == "waiting":
            raise UnexpectedMessage(f"{message.kind!r} before begin")
        if message.kind == "chunk":
            self._on_chunk(message.header, message.body, message.body_crc)
        elif message.kind == "end":
            self._on_end(message.header)
        else:
            raise UnexpectedMessage(f"unexpected message kind {message.kind!r:.40}")
        return self._maybe_complete()

    def _fail(self) -> None:
        # Drop the buffers now: a refused handoff must not pin memory until GC.
        self._state = "failed"
        self._layers.clear()
        self._expected.clear()
        self._landing.clear()
        self._placed.clear()
        self._stock.release()
        self.allocated_bytes = 0

    # -- begin -------------------------------------------------------------

    def _on_begin(self, message: KVMessage) -> None:
        if self._state == "receiving":
            if not self._same_begin(message):
                raise UnexpectedMessage("a second, different begin for this handoff")
            return
        self._start(HandoffHeader.from_message(message, self.limits.max_prompt_tokens))

    def _start(self, header: HandoffHeader) -> None:
        self._check_identity(header)
        header.fingerprint.check_supported()
        header.fingerprint.check_matches(self.local)
        check_delta_begin(header)
        self._codec = resolve_codec(header.codec, self.codecs)
        self._check_budget(header)
        self.header = header
        self._state = "receiving"
        self._ready_expected(header)

    def _ready_expected(self, header: HandoffHeader) -> None:
        """Allocate now each layer whose shape the begin implies (``expected_layers``), in the
        engine's own buffers: a pool's go back to it as each layer is adopted by copying."""
        if self.memory.make_buffers is None:
            return
        for index, descriptor in expected_layers(self.local, header):
            before = self.allocated_bytes
            try:
                self._allocate(index, descriptor)
            except HandoffError:  # no buffers now: left to the chunks, which ask again
                return
            self._expected[index] = self.allocated_bytes - before

    def _same_begin(self, message: KVMessage) -> bool:
        try:
            return HandoffHeader.from_message(message, self.limits.max_prompt_tokens) == self.header
        except HandoffError:
            return False

    def _check_identity(self, header: HandoffHeader) -> None:
        wanted = self.expected_request_id
        if wanted is not None and header.request_id != wanted:
            raise RequestMismatch(f"handoff for {header.request_id!r}, expected {wanted!r}")
        if header.epoch < self.min_epoch:
            raise StaleEpoch(f"epoch {header.epoch} is older than {self.min_epoch}")

    def _check_budget(self, header: HandoffHeader) -> None:
        # No layer holds more tokens than it ships: this bounds every later allocation.
        bound = header.fingerprint.kv_bytes(header.shipped_tokens)
        if bound > self.limits.max_bytes:
            raise OversizeDeclared(f"cache of up to {bound} bytes > budget {self.limits.max_bytes}")

    # -- chunks ------------------------------------------------------------

    def chunk_destination(self, raw: Any) -> memoryview | list[memoryview] | LandedDecode | None:
        """Where a chunk's body may be written before it is fed: its rows' bytes (raw: one
        view, or per-head pieces filled in order where the layer has room), a ``LandedDecode``
        (coded: decoded into its rows where it lands), or None.

        The header gets every check ``feed`` applies and its rows are claimed, so no
        other chunk can take them; it counts once fed, this same header object with
        the body (written there, or anywhere else). Never raises: a header that would
        be refused gets None here and its refusal from ``feed``.
        """
        if self._state != "receiving" or self._codec is None:
            return None
        try:
            chunk = ChunkHeader.from_dict(raw)
            layer, spec = self._checked_chunk(chunk, chunk.nbytes), self._spec(chunk)
            landing = landing_for(self._codec, chunk, layer.tensors[chunk.tensor], spec,
                                  self.memory)
            if landing is None and chunk.nbytes != chunk.rows * spec.row_bytes:
                return None  # not a raw body: feed refuses it
            self._claim(chunk, layer)
        except HandoffError:
            return None
        views = None if landing else layer.rows_views(chunk.tensor, chunk.row, chunk.rows)
        self._placed[id(raw)] = (raw, chunk, views)
        if landing is not None:
            self._landing[landing.key] = landing
            return landing
        return views[0] if len(views) == 1 else views

    def _on_chunk(self, raw: Any, body: Any, body_crc: int | None = None) -> None:
        placed = self._placed.pop(id(raw), None)
        if placed is not None and placed[0] is raw:  # checked, rows claimed: chunk_destination
            _, chunk, views = placed
            layer = self._layers[chunk.layer]
        else:
            chunk, views = ChunkHeader.from_dict(raw), None
            layer = self._checked_chunk(chunk, len(body))
            self._claim(chunk, layer)
        if len(body) != chunk.nbytes:
            raise TruncatedLayer(f"layer {chunk.layer} {chunk.tensor} chunk body {len(body)} "
                                 f"of {chunk.nbytes} bytes")
        landing = self._landing.pop((chunk.layer, chunk.tensor, chunk.row), None)
        in_place = occupies(body, views or layer.rows_views(chunk.tensor, chunk.row, chunk.rows))
        if landing is not None and landing.done and occupies(body, landing.body):
            if landing.error is not None:  # decoded on the link's thread, and failed there
                raise landing.error
        elif not in_place:
            decode_chunk_into(self._codec, chunk, body, layer.tensors[chunk.tensor],
                              self._spec(chunk))
        self.received_chunks += 1
        self.received_bytes += len(body)
        if self._end is not None and self.received_chunks > self._end.chunks:
            raise UnexpectedMessage(f"more chunks than the {self._end.chunks} declared")
        # A crc taken as the body landed covers these rows' bytes only when it landed there;
        # it always covers the body (what "encoded" checksums cover).
        landed_crc = body_crc if in_place or layer.crc_of_bodies else None
        if layer.tensor_filled(chunk.tensor, chunk.row, chunk.rows, landed_crc, body):
            self._tensor_complete(chunk.layer, layer, chunk.tensor)

    def _checked_chunk(self, chunk: ChunkHeader, body_bytes: int) -> ReceivedLayer:
        """The chunk's layer (allocated on its first chunk) once the header's bounds hold."""
        self._check_attempt(chunk.handoff_id, chunk.epoch)
        layer = self._layer_for(chunk)
        raw_bytes = chunk.rows * self._spec(chunk).row_bytes
        if raw_bytes > self.limits.max_chunk_raw_bytes:
            raise OversizeDeclared(f"chunk of {raw_bytes} decoded bytes is too large")
        if max(chunk.nbytes, body_bytes) > self.limits.max_body_bytes:
            raise OversizeDeclared(f"chunk body of {chunk.nbytes} bytes exceeds "
                                  f"{self.limits.max_body_bytes}")
        rows = layer.rows(chunk.tensor)
        if chunk.row + chunk.rows > rows:
            raise MalformedHandoff(f"chunk rows {chunk.row}+{chunk.rows} beyond {rows}")
        return layer

    def _spec(self, chunk: ChunkHeader) -> ArraySpec:
        """The array a chunk belongs to, by its layer's spec (an unknown name is refused)."""
        return self.local.layers[chunk.layer].array(chunk.tensor)

    def _claim(self, chunk: ChunkHeader, layer: ReceivedLayer) -> None:
        claimed = layer.claimed[chunk.tensor][chunk.row : chunk.row + chunk.rows]
        if claimed.any():
            raise UnexpectedMessage(f"layer {chunk.layer} {chunk.tensor} rows overlap a chunk")
        claimed[:] = True

    def _tensor_complete(self, index: int, layer: ReceivedLayer, tensor: str) -> None:
        """Check a whole tensor against end (when known); adopt the layer once both are whole."""
        if self._end is not None and layer.checksummed:
            self._check_crc(index, layer, tensor)
        if layer.complete and self.adopt is not None:
            layer.adopt(self.adopt)

    def _check_crc(self, index: int, layer: ReceivedLayer, tensor: str) -> None:
        end = self._end
        if end is None:  # only reachable through a bug: checked once end has arrived
            raise UnexpectedMessage("no end yet")
        position = self.local.layers[index].names.index(tensor)
        got, want = layer.crcs[tensor], end.checksums[index][position]
        if got != want:
            raise ChecksumMismatch(f"layer {index} {tensor}: crc32 {got:#x} != {want:#x}")

    def _begun(self) -> HandoffHeader:
        if self.header is None:  # only reachable through a bug: chunks need a begin first
            raise UnexpectedMessage("no begin yet")
        return self.header

    def _check_attempt(self, handoff_id: str, epoch: int) -> None:
        header = self._begun()
        if handoff_id != header.handoff_id or epoch != header.epoch:
            raise StaleEpoch(f"message for handoff {handoff_id!r:.80} epoch {epoch}, "
                             f"receiving {header.handoff_id!r} epoch {header.epoch}")

    def _layer_for(self, chunk: ChunkHeader) -> ReceivedLayer:
        fp = self.local
        if chunk.layer >= fp.num_layers:
            raise LayerCountMismatch(f"chunk for layer {chunk.layer} of {fp.num_layers}")
        existing = self._layers.get(chunk.layer)
        readied = self._expected.pop(chunk.layer, None)  # its first chunk is this one
        if existing is not None and existing.descriptor == chunk.descriptor:
            return existing
        if existing is not None and readied is None:
            raise UnexpectedMessage(f"layer {chunk.layer} descriptor changed between chunks")
        if existing is not None:  # readied for another shape than the sender's
            del self._layers[chunk.layer]
            self.allocated_bytes -= readied
        descriptor = chunk.descriptor
        prompt_length = self._begun().prompt_length
        if not descriptor.tokens <= descriptor.offset <= prompt_length:
            raise MalformedHandoff(f"layer {chunk.layer}: tokens {descriptor.tokens}, offset "
                                   f"{descriptor.offset}, prompt_length {prompt_length} disagree")
        check_delta_layer(chunk.layer, descriptor, self._begun())
        return self._allocate(chunk.layer, descriptor)

    def _allocate(self, index: int, descriptor: LayerDescriptor) -> ReceivedLayer:
        fp, spec = self.local, self.local.layers[index]
        buffers, size = layer_allocation(self._stock, fp, index, descriptor, self._begun(),
                                         self.allocated_bytes, self.limits.max_bytes,
                                         self._layers)
        rows = {a.name: a.rows(descriptor.tokens) for a in spec.arrays}
        layer = ReceivedLayer(
            descriptor=descriptor,
            kind=fp.cache_classes[index],
            dtype=fp.dtype,
            tensors=dict(zip(spec.names, buffers, strict=True)),
            claimed={name: np.zeros(n, dtype=bool) for name, n in rows.items()},
            rows_left=dict(rows),
            crc_of_bodies=self._begun().checksum_of == CHECKSUM_OF_ENCODED,
            checksummed=self._begun().checksummed,
        )
        self._layers[index] = layer
        self.allocated_bytes += size
        return layer

    # -- end ---------------------------------------------------------------

    def _on_end(self, raw: Any) -> None:
        if self._end is not None:
            raise UnexpectedMessage("a second end for this handoff")
        end = EndHeader.from_dict(raw)
        self._check_attempt(end.handoff_id, end.epoch)
        if end.num_layers != self.local.num_layers:
            raise LayerCountMismatch(f"end lists {end.num_layers} layers, this model has "
                                     f"{self.local.num_layers}")
        if self.received_chunks > end.chunks:
            raise UnexpectedMessage(f"{self.received_chunks} chunks, end declares {end.chunks}")
        for index, crcs in enumerate(end.checksums):
            if len(crcs) != len(self.local.layers[index].arrays):
                raise MalformedHandoff(f"end lists {len(crcs)} checksums for layer {index}")
        self._end = end
        for index, layer in sorted(self._layers.items()):
            for tensor in layer.crcs:
                self._check_crc(index, layer, tensor)

    def _maybe_complete(self) -> SerializableCacheState | None:
        end = self._end
        if end is None or self.received_chunks < end.chunks:
            return None
        for index in range(self.local.num_layers):
            layer = self._layers.get(index)
            if layer is None or not layer.complete:
                raise TruncatedLayer(f"layer {index} is incomplete after {end.chunks} chunks")
        # Every tensor was checked against end as it completed (or when end arrived).
        self._state, state = "done", SerializableCacheState(self._begun(), self._cache_state())
        self._layers.clear()  # the state holds them: a view kept here makes MLX copy at decode
        self._placed.clear()
        self._stock.release()
        return state

    def _cache_state(self) -> CacheState:
        return CacheState([layer.cache_layer() for _, layer in sorted(self._layers.items())])
