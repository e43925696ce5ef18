"""Decode side of the KV handoff: KV frames in (any lane, any order), caches out.

Assembly runs here, on the event loop, never on the engine thread: a KV
arriving cannot stall a decode step. Several handoffs are in flight at once,
routed by ``handoff_id``; the begin is checked by ``admit`` (capacity, known
request, fingerprint) before anything is allocated. Every refusal names its
code (it goes into the KV_ACK) and frees the partial cache.

Receive buffers are the engine's own memory where it offers ``kv_buffers``
(``engine_api.kv_buffer_maker``), else come from one ``BufferPool``;
``body_destination`` is the links' body sink, so a raw chunk's body is
decrypted straight into its place in the layer buffer. With the engine's
``adopt`` (``engine_api.layer_adopter``) each layer becomes the engine's arrays
as soon as it is whole and verified, while the next layers arrive (pooled
buffers are copied and go back to the pool at once).

Memory after load: once no handoff has begun for ``idle_release_s``, glibc
is asked to give freed pages back; the pool's slabs (bounded by its
``max_bytes``) stay, faulted in, for the next handoff: a decode node waiting
out a long prefill used to drop them and take that handoff into fresh pages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from mlxcel_plugin.engine_api import KVBufferMaker, LayerAdopter
from mlxcel_plugin.errors import AtCapacityError, HandoffError, MlxcelError
from mlxcel_plugin.kv_codecs import KVCodec
from mlxcel_plugin.kv_serde import (
    AssemblerLimits,
    HandoffHeader,
    KVAssembler,
    ModelFingerprint,
    ReceiveMemory,
    SerializableCacheState,
)
from mlxcel_plugin.kv_serde.convert import Arrival
from mlxcel_plugin.kv_serde.pool import BufferPool, give_back_to_os, pool_bytes_for
from mlxcel_plugin.link import Link
from mlxcel_plugin.link.protocol.frames import BodyParts, Frame, FrameType
from mlxcel_plugin.link.read_load import ReadLoad
from mlxcel_plugin.nodes.kv_wire import chunk_destinations, end_first_token, frame_to_messages

logger = logging.getLogger(__name__)

# admit(header) raises to refuse a handoff before anything is allocated.
Admit = Callable[[HandoffHeader], None]
IDLE_RELEASE_S = 5.0
DEFAULT_KV_BUDGET_BYTES = 4 << 30


@dataclass
class Ingest:
    """One handoff attempt being received."""

    request_id: str
    handoff_id: str
    epoch: int
    reply: Link  # acks go back on the link that brought the begin
    assembler: KVAssembler
    # Each link its frames came on, with its bulk readers' load when it joined: how busy
    # they were over this handoff says whether the decode node set its pace.
    lanes: dict[Link, ReadLoad] = field(default_factory=dict)
    started_s: float = field(default_factory=time.monotonic)
    # When its last frame came: it times out once nothing came for ``transfer_timeout_s``,
    # so a handoff slower than that (a long prompt on a slow or busy link) still lands.
    progressed_s: float = field(default_factory=time.monotonic)
    first_token: int | None = None

    def join(self, link: Link) -> None:
        if link not in self.lanes:
            self.lanes[link] = link.bulk_read_load()

    def reader_busy_share(self) -> float | None:
        """How much of its lanes' reading time their readers were running or waiting for a
        CPU (link/read_load.py); near 1, the decode node set the pace, not the link."""
        load = sum((link.bulk_read_load() - at for link, at in self.lanes.items()), ReadLoad())
        return load.busy_share


@dataclass(frozen=True)
class Completed:
    ingest: Ingest
    state: SerializableCacheState
    first_token: int
    reader_busy_share: float | None = None  # Ingest.reader_busy_share, for the ack


@dataclass(frozen=True)
class Refused:
    request_id: str
    handoff_id: str
    epoch: int
    reply: Link
    error: MlxcelError
    admitted: bool = True  # False: refused at the begin, nothing was reserved


Outcome = Completed | Refused | None


class HandoffReceiver:
    def __init__(self, local: ModelFingerprint, codecs: Mapping[str, KVCodec], admit: Admit,
                 limits: AssemblerLimits | None = None, pool: BufferPool | None = None,
                 adopt: LayerAdopter | None = None, make_buffers: KVBufferMaker | None = None,
                 *, kv_budget_bytes: int = DEFAULT_KV_BUDGET_BYTES, model_bytes: int = 0,
                 idle_release_s: float = IDLE_RELEASE_S, plain: ModelFingerprint | None = None):
        self.local, self.codecs, self.admit = local, codecs, admit
        # What converts on arrival (another dtype; plain K/V a kv_bits engine quantizes).
        self.arrival = Arrival(local, plain)
        self.limits = limits or AssemblerLimits()
        pool = pool or BufferPool(pool_bytes_for(kv_budget_bytes, model_bytes))
        self.memory = ReceiveMemory(pool, make_buffers)
        self.adopt = adopt
        self.ingests: dict[str, Ingest] = {}  # by handoff_id
        self.idle_release_s = idle_release_s
        self._last_begin_s = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        logger.info("KV receive buffers: %s; freed ones kept warm up to %d MiB",
                    "the engine's" if make_buffers else "pooled", pool.max_bytes >> 20)

    @property
    def allocated_bytes(self) -> int:
        return sum(i.assembler.allocated_bytes for i in self.ingests.values())

    def by_request(self, request_id: str) -> Ingest | None:
        return next((i for i in self.ingests.values() if i.request_id == request_id), None)

    def body_destination(self, frame_type: FrameType, header: dict,
                         n_bytes: int) -> memoryview | BodyParts | None:
        """A link body sink: where a KV_CHUNK body's chunks belong in their handoff's buffers."""
        if frame_type is not FrameType.KV_CHUNK:
            return None
        handoff_id = header.get("handoff_id")
        ingest = self.ingests.get(handoff_id) if isinstance(handoff_id, str) else None
        if ingest is None or header.get("epoch") != ingest.epoch:
            return None
        begun = ingest.assembler.header
        return chunk_destinations(ingest.assembler.chunk_destination, header, n_bytes,
                                  checksums=begun is None or begun.checksummed)

    def feed(self, link: Link, frame: Frame) -> Outcome:
        """Apply one KV frame; raises MalformedHandoff when it cannot even be routed."""
        try:
            return self._feed(link, frame)
        finally:
            self._release_later_if_idle()

    def _feed(self, link: Link, frame: Frame) -> Outcome:
        handoff_id, epoch = _route(frame)
        ingest = self.ingests.get(handoff_id)
        if frame.type is FrameType.KV_BEGIN:
            if ingest is None or epoch > ingest.epoch:
                return self._begin(link, frame, handoff_id, epoch)
        if ingest is None or epoch != ingest.epoch:
            # A refused, finished or superseded attempt's late frames: nothing to do.
            logger.debug("dropping %s for handoff %s epoch %d", frame.type.name, handoff_id, epoch)
            return None
        ingest.join(link)
        ingest.progressed_s = time.monotonic()
        try:
            if frame.type is FrameType.KV_END:
                ingest.first_token = end_first_token(frame)
            state = None
            for message in frame_to_messages(frame):
                state = ingest.assembler.feed(message)
        except HandoffError as exc:
            return self._refuse(ingest, exc)
        if state is None:
            return None
        del self.ingests[handoff_id]
        first = state.header.first_token if ingest.first_token is None else ingest.first_token
        return Completed(ingest, state, first, ingest.reader_busy_share())

    def _begin(self, link: Link, frame: Frame, handoff_id: str, epoch: int) -> Outcome:
        self._last_begin_s = time.monotonic()
        old = self.ingests.pop(handoff_id, None)
        if old is not None:  # a retry supersedes the attempt still arriving
            _free(old.assembler)
        request_id = frame.header.get("request_id")
        request_id = request_id if isinstance(request_id, str) else ""
        try:
            (begin,) = frame_to_messages(frame)
            header = HandoffHeader.from_message(begin, self.limits.max_prompt_tokens)
            header.fingerprint.check_supported()
            held = self.arrival.fingerprint_for(header.fingerprint)  # raises a mismatch
            self.admit(header)
        except (HandoffError, AtCapacityError) as exc:
            return Refused(request_id, handoff_id, epoch, link, exc, admitted=False)
        assembler = KVAssembler(held, self.codecs, self.limits,
                                expected_request_id=header.request_id, memory=self.memory,
                                adopt=self.adopt)
        ingest = Ingest(header.request_id, handoff_id, epoch, link, assembler)
        ingest.join(link)
        self.ingests[handoff_id] = ingest
        try:
            assembler.begin(header)
        except HandoffError as exc:
            return self._refuse(ingest, exc)
        return None

    def _refuse(self, ingest: Ingest, error: MlxcelError) -> Refused:
        self.ingests.pop(ingest.handoff_id, None)
        _free(ingest.assembler)
        return Refused(ingest.request_id, ingest.handoff_id, ingest.epoch, ingest.reply, error)

    def drop(self, request_id: str, error: MlxcelError) -> list[Refused]:
        """Abandon every ingest of ``request_id`` (cancelled, timed out)."""
        refused = [self._refuse(i, error) for i in list(self.ingests.values())
                   if i.request_id == request_id]
        self._release_later_if_idle()
        return refused

    def drop_link(self, link: Link, error: MlxcelError) -> list[Refused]:
        """The sending prefill node went away: its unfinished handoffs cannot complete."""
        refused = [self._refuse(i, error) for i in list(self.ingests.values()) if link in i.lanes]
        self._release_later_if_idle()
        return refused

    # -- memory after load ---------------------------------------------------------------

    def _release_later_if_idle(self) -> None:
        if self.ingests or self._idle_timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # fed outside a loop (unit tests): nothing to schedule on
            return
        self._idle_timer = loop.call_later(self.idle_release_s, self._release_if_idle)

    def _release_if_idle(self) -> None:
        self._idle_timer = None
        quiet_s = time.monotonic() - self._last_begin_s
        if self.ingests:
            return  # the last of them to end schedules the next look
        if quiet_s < self.idle_release_s:  # a handoff came and went meanwhile: look again later
            loop = asyncio.get_running_loop()
            self._idle_timer = loop.call_later(self.idle_release_s - quiet_s,
                                               self._release_if_idle)
            return
        give_back_to_os()  # the pool's slabs stay warm: the next handoff may be on its way

    def pool_bytes(self) -> tuple[int, int]:
        """(bound, held now) of the freed receive buffers kept warm: the engine's pool where
        its ``kv_buffers`` has one (``pool_bytes()``), else this receiver's ``BufferPool``."""
        engine_pool = getattr(self.memory.make_buffers, "pool_bytes", None)
        if engine_pool is not None:
            return engine_pool()
        pool = self.memory.pool
        return (pool.max_bytes, pool.held_bytes) if pool is not None else (0, 0)

    def release_memory(self) -> int:
        """Free the pool's unlent slabs and return freed heap pages to the OS; bytes freed."""
        freed = self.memory.pool.release_free() if self.memory.pool is not None else 0
        give_back_to_os()
        logger.debug("idle: released %d MiB of receive buffers", freed >> 20)
        return freed

    def stalled_since(self, cutoff_s: float) -> list[Ingest]:
        """Handoffs whose last frame came before ``cutoff_s``."""
        return [i for i in self.ingests.values() if i.progressed_s < cutoff_s]


def _free(assembler: KVAssembler) -> None:
    """Mark the assembler failed and drop its buffers now, not at GC."""
    try:
        assembler.expire()
    except HandoffError:
        return  # expire() always raises, naming what was missing; we already know why


def _route(frame: Frame) -> tuple[str, int]:
    handoff_id, epoch = frame.header.get("handoff_id"), frame.header.get("epoch")
    if not isinstance(handoff_id, str) or not handoff_id or len(handoff_id) > 256:
        raise HandoffError("KV frame without a valid handoff_id", code="handoff_malformed")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise HandoffError("KV frame without a valid epoch", code="handoff_malformed")
    return handoff_id, epoch
