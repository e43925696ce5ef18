"""Prefill side of the KV handoff: links to decode nodes, ordered sends, acks.

``DecodeLinks`` dials (and redials) the links to each decode node — lane i is the i-th link,
for LayerParallel — reads KV_ACK frames off them and resolves the matching
``OutgoingHandoff``. An ``OutgoingHandoff`` is one attempt: the strategy's messages are
queued as they are produced (``on_layer`` during prefill, for Streamed) and one task frames
them, so the engine thread never waits on a socket; each lane's ``LaneFeed`` sends its
frames in order, so a full or stalled lane holds up only its own.

The strategy's calls (where a codec encodes: int8 takes ~8 ms per 2k-token layer) run on
the node's ``encoder`` thread, in order, not on the event loop: other requests' HTTP and link
traffic keep flowing while a handoff encodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from mlxcel_plugin.engine_api import CacheLayer
from mlxcel_plugin.errors import HandoffError, MlxcelError, NodeLostError
from mlxcel_plugin.kv_serde import AckHeader, HandoffHeader, KVMessage
from mlxcel_plugin.link import (
    RETRYABLE,
    Backoff,
    ClusterSecret,
    Link,
    LinkClosed,
    LinkConfig,
    dial_with_backoff,
)
from mlxcel_plugin.link.protocol.frames import Cancel, Frame, FrameType
from mlxcel_plugin.link.tcp_chrono import Counts, busiest_since
from mlxcel_plugin.nodes.kv_wire import announced_serde_versions, frame_chunk_bytes, frames_for
from mlxcel_plugin.transfer import TransferStrategy, sends_rows_ahead
from mlxcel_plugin.transfer.pacing import LinkSample

logger = logging.getLogger(__name__)

DIAL_ATTEMPTS = 3
# Encoded or waiting bytes not yet handed to a link beyond which prefill cells' rows stop
# going ahead (the rest of each layer goes with the layer): over a link slower than
# prefill the node would otherwise hold a copy of nearly all the K/V beside the cache.
ROWS_BACKLOG_BYTES = 64 << 20
_DIAL_BACKOFF = Backoff(initial_s=0.05, max_s=0.5)
_DONE = object()


class TargetLost(NodeLostError):
    code = "decode_node_lost"


@dataclass
class OutgoingHandoff:
    """One attempt of one handoff; ``ack`` resolves with the decode node's answer."""

    header: HandoffHeader
    strategy: TransferStrategy
    target: str
    started_s: float = field(default_factory=time.monotonic)
    first_chunk_s: float | None = None  # the first chunk was handed to a link
    finished_s: float | None = None  # the cache was complete (prefill ended)
    # At that moment: bytes handed to links so far, and bytes the links still held.
    sent_by_finish_bytes: int = 0
    queued_at_finish_bytes: int = 0
    # The links' connections' time with data in flight at the first chunk and at finish,
    # to tell who paced each window (transfer/pacing.py).
    chrono_at_first_chunk: Counts = ()
    chrono_at_finish: Counts = ()
    chunks_ahead: int = 0  # chunks of prefill cells' rows, sent before their layers
    rows_stopped: bool = False  # the backlog passed ROWS_BACKLOG_BYTES: no more rows ahead
    sent_bytes: int = 0
    # The last frame handed to a link (the link takes more only as it drains; None: none yet):
    # the handoff times out once nothing moved for ``transfer_timeout_s``, not once it took
    # that long.
    progressed_s: float | None = None
    began: bool = False  # a begin went out: the decode node may hold state to drop
    aborted: bool = False
    first_token: int | None = None  # set by finish()
    encoder: Executor | None = None  # runs the strategy's calls in order; None: inline

    def __post_init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.ack: asyncio.Future[AckHeader] = self._loop.create_future()
        self.ack.add_done_callback(self._on_answer)
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._links: list[Link] = []  # once dialed
        self._pushed_bytes = 0  # message bodies queued to be framed
        self._rows_encoding_bytes = 0  # rows handed to the encoder, not yet queued

    def _on_answer(self, ack: asyncio.Future[AckHeader]) -> None:
        """A refusal stops the sending: the decode node drops the rest of this attempt.

        (A delta's ``prefix_missing`` comes at the begin, while prefill still streams layers.)
        """
        if not ack.cancelled() and ack.exception() is None and not ack.result().ok:
            self.aborted = True
            if self._task is not None:
                self._task.cancel()

    @property
    def key(self) -> tuple[str, str, int]:
        return self.header.request_id, self.header.handoff_id, self.header.epoch

    def push(self, messages: Iterable[object], rows_bytes: int = 0) -> None:
        """Queue messages to be framed; ``rows_bytes``: the rows they were encoded from."""
        self._rows_encoding_bytes -= rows_bytes
        for message in messages:
            self._pushed_bytes += len(getattr(message, "body", b""))
            self._queue.put_nowait(message)

    @property
    def backlog_bytes(self) -> int:
        """What this handoff holds that no link has taken yet (rows still encoding too)."""
        return self._rows_encoding_bytes + self._pushed_bytes - self.sent_bytes

    def add_layer(self, index: int, layer: CacheLayer) -> None:
        if not self.aborted:
            self._plan(self._layer_messages, index, layer)

    def add_rows(self, index: int, first_token: int, arrays: Mapping[str, Any]) -> None:
        if self.aborted or not sends_rows_ahead(self.strategy) or self.rows_stopped:
            return
        if self.backlog_bytes > ROWS_BACKLOG_BYTES:  # the link is behind prefill
            self.rows_stopped = True  # for good: a layer's later rows would leave a gap
            return
        nbytes = sum(array.nbytes for array in arrays.values())
        self._rows_encoding_bytes += nbytes
        self._plan(self._rows_messages, index, first_token, arrays, rows_bytes=nbytes)

    def finish(self, first_token: int) -> None:
        self.finished_s = time.monotonic()
        self.sent_by_finish_bytes = self.sent_bytes
        self.queued_at_finish_bytes = sum(link.queued_bytes for link in self._links)
        self.chrono_at_finish = self._chrono()
        self.first_token = first_token  # goes out with the end
        ended = getattr(self.strategy, "prefill_ended", None)
        if ended is not None:  # now, not behind the layers the encoder still works on
            ended()
        self._plan(self._final_messages)

    def _layer_messages(self, index: int, layer: CacheLayer) -> list[KVMessage]:
        # Refused or failed meanwhile (the encoder may run behind): the rest need no encoding.
        return [] if self.aborted else self.strategy.add_layer(index, layer)

    def _rows_messages(self, index: int, first_token: int,
                       arrays: Mapping[str, Any]) -> list[KVMessage]:
        if self.aborted:
            return []
        messages = self.strategy.add_rows(index, first_token, arrays)
        self.chunks_ahead += len(messages)
        return messages

    def _final_messages(self) -> list[object]:
        return [_DONE] if self.aborted else [*self.strategy.finish(), _DONE]

    def _plan(self, step: Callable[..., list], *args: object, rows_bytes: int = 0) -> None:
        """Queue what ``step(*args)`` returns: on the encoder thread where there is one (its
        one worker keeps the order), else now; a HandoffError fails this handoff only."""
        push = partial(self.push, rows_bytes=rows_bytes)
        if self.encoder is None:
            _run_step(step, args, push, self.fail)
            return
        loop = self._loop

        def failed(exc: BaseException) -> None:
            self.aborted = True  # now: the steps queued behind this one skip their work
            _call_soon(loop, self.fail, exc)

        try:
            self.encoder.submit(_run_step, step, args, partial(_call_soon, loop, push), failed)
        except RuntimeError:  # the encoder shut down: the node is closing
            self.fail(HandoffError("the prefill node is shutting down", code="cancelled"))

    def fail(self, exc: BaseException) -> None:
        """Stop sending; the waiter sees ``exc``."""
        self.aborted = True
        if not self.ack.done():
            self.ack.set_exception(exc)
        if self._task is not None:
            self._task.cancel()

    def run(self, lanes: asyncio.Task[list[Link]]) -> None:
        self._task = asyncio.create_task(self._send_all(lanes), name="kv-handoff-send")

    async def _send_all(self, lanes_task: asyncio.Task[list[Link]]) -> None:
        feeds: list[LaneFeed] = []
        try:
            lanes = self._links = await lanes_task
            feeds = [LaneFeed(link, self._sent, self._lane_failed) for link in lanes]
            finished = False
            while not finished:  # ends with finish()
                messages, finished = await self._queued()
                # What queued up while the last frames went out shares frames now.
                bound = frame_chunk_bytes(messages, [link.bulk_lanes for link in lanes])
                for lane, frame in frames_for(messages, self.first_token, bound):
                    feeds[lane % len(feeds)].put(frame)
            for feed in feeds:
                await feed.close()  # every frame handed to its link
        except (*RETRYABLE, MlxcelError) as exc:
            self._lane_failed(exc)
        finally:
            for feed in feeds:
                feed.cancel()

    def _sent(self, frame: Frame) -> None:
        self.began = self.began or frame.type is FrameType.KV_BEGIN
        if self.first_chunk_s is None and frame.type is FrameType.KV_CHUNK:
            self.first_chunk_s = time.monotonic()
            self.chrono_at_first_chunk = self._chrono()
        self.sent_bytes += len(frame.body)
        self.progressed_s = time.monotonic()

    def _chrono(self) -> Counts:
        """Every connection of the handoff's links (none before they are dialed)."""
        return tuple(count for link in self._links for count in link.body_tcp_chronos())

    def link_sample(self, acked_s: float) -> LinkSample:
        """The window to measure the link by; each window can only undercount it.
        From the end of prefill: what was handed to the links since plus what they still
        held then (low by what sat in socket buffers: seconds of a slow link). From the
        first chunk, every byte: the faster of the two, unless cells' rows went ahead at
        prefill's pace. Where the link kept up with prefill, little is left after it and the
        estimator drops the sample as too small. Each carries its connections' clocks."""
        now = self._chrono()
        after_bytes = self.sent_bytes - self.sent_by_finish_bytes + self.queued_at_finish_bytes
        after = LinkSample(after_bytes, acked_s - (self.finished_s or self.started_s),
                           busiest_since(now, self.chrono_at_finish))
        if self.chunks_ahead:
            return after
        whole = LinkSample(self.sent_bytes, acked_s - (self.first_chunk_s or self.started_s),
                           busiest_since(now, self.chrono_at_first_chunk))
        return max(whole, after, key=lambda s: s.nbytes / s.seconds if s.seconds > 0 else 0.0)

    def _lane_failed(self, exc: BaseException) -> None:
        self.fail(TargetLost(f"decode node {self.target} unreachable: {exc!r:.200}"))

    async def _queued(self) -> tuple[list[KVMessage], bool]:
        """Every message queued now (waits for one), and whether finish() came after them."""
        items = [await self._queue.get()]
        while not self._queue.empty():  # bounded by what is queued
            items.append(self._queue.get_nowait())
        return [i for i in items if i is not _DONE], _DONE in items  # type: ignore[misc]


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable, value: object) -> None:
    with contextlib.suppress(RuntimeError):  # the loop closed: the node is gone
        loop.call_soon_threadsafe(callback, value)


def _run_step(step: Callable[..., list], args: tuple, done: Callable[[list], None],
              failed: Callable[[BaseException], None]) -> None:
    try:
        items = step(*args)
    except HandoffError as exc:
        failed(exc)
        return
    except Exception as exc:  # a plugin strategy's or codec's own bug: this handoff fails
        logger.exception("KV handoff step %s failed", getattr(step, "__name__", step))
        failed(HandoffError(f"encoding the KV failed: {exc!r:.200}"))
        return
    done(items)


class LaneFeed:
    """One lane's frames, in order; a full lane holds up only its own frames.

    A frame goes straight into the link's send queue while it has room (no
    task hop). The first frame that finds it full starts a task that sends it
    and every later frame of this lane in order, while the other lanes of a
    LayerParallel handoff keep going.
    """

    def __init__(self, link: Link, on_sent: Callable[[Frame], None],
                 on_failed: Callable[[BaseException], None]):
        self.link = link
        self._frames: asyncio.Queue[Frame | None] = asyncio.Queue()
        self._on_sent, self._on_failed = on_sent, on_failed
        self._task: asyncio.Task[None] | None = None

    def put(self, frame: Frame) -> None:
        """Raises LinkClosed if the link is already closed."""
        if self._task is None and self.link.try_send(frame):
            self._on_sent(frame)
            return
        self._frames.put_nowait(frame)
        if self._task is None:
            self._task = asyncio.create_task(self._send_in_order(), name="kv-lane-send")

    async def close(self) -> None:
        """Wait until every frame put so far has been handed to the link."""
        if self._task is not None:
            self._frames.put_nowait(None)
            await self._task

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _send_in_order(self) -> None:
        try:
            while (frame := await self._frames.get()) is not None:  # ends at close()
                await self.link.send(frame)
                self._on_sent(frame)
        except (*RETRYABLE, MlxcelError) as exc:
            self._on_failed(exc)


class DecodeLinks:
    """Links from this prefill node to decode nodes, and the acks that come back."""

    def __init__(self, secret: ClusterSecret, node_id: str, config: LinkConfig | None = None):
        self._secret, self._node_id, self._config = secret, node_id, config or LinkConfig()
        self._links: dict[str, list[Link]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._waiting: dict[tuple[str, str, int], OutgoingHandoff] = {}
        self._readers: set[asyncio.Task[None]] = set()
        self._serde_versions: dict[str, frozenset[int]] = {}  # target -> what it announced

    def start(self, handoff: OutgoingHandoff, lanes: int) -> None:
        self._waiting[handoff.key] = handoff
        handoff.ack.add_done_callback(lambda _: self._waiting.pop(handoff.key, None))
        handoff.run(asyncio.create_task(self.lanes(handoff.target, lanes)))

    async def lanes(self, target: str, count: int) -> list[Link]:
        """``count`` open links to ``target``, dialing the missing ones."""
        async with self._locks.setdefault(target, asyncio.Lock()):
            links = [link for link in self._links.get(target, []) if not link.closed]
            while len(links) < count:  # one dial per missing lane
                links.append(await self._dial(target))
            self._links[target] = links
            return links[:count]

    def speaks(self, target: str, serde_version: int) -> bool:
        """Whether ``target`` announced ``serde_version`` on a link dialed to it (False before
        any link: a first handoff keeps to the oldest format its content allows)."""
        return serde_version in self._serde_versions.get(target, frozenset())

    async def _dial(self, target: str) -> Link:
        link = await dial_with_backoff(target, self._secret, "prefill", self._node_id,
                                       expect_roles={"decode"}, config=self._config,
                                       backoff=_DIAL_BACKOFF, max_attempts=DIAL_ATTEMPTS)
        self._serde_versions[target] = announced_serde_versions(link.peer_announce)
        task = asyncio.create_task(self._read(target, link), name="kv-ack-reader")
        self._readers.add(task)
        task.add_done_callback(self._readers.discard)
        return link

    async def _read(self, target: str, link: Link) -> None:
        async for frame in link:  # until the link closes
            self._on_frame(target, frame)
        self._lost(target, link)

    def _on_frame(self, target: str, frame: Frame) -> None:
        if frame.type is FrameType.KV_ACK:
            self._on_ack(frame)
        elif frame.type is FrameType.ERROR:
            logger.warning("%s: decode node %s reported %s", self._node_id, target, frame.header)

    def _on_ack(self, frame: Frame) -> None:
        try:
            ack = AckHeader.from_dict(frame.header)
        except HandoffError as exc:
            logger.warning("%s: malformed KV_ACK ignored: %s", self._node_id, exc.message)
            return
        handoff = self._waiting.get((ack.request_id, ack.handoff_id, ack.epoch))
        if handoff is None:
            logger.debug("%s: ack for %s epoch %d nobody waits for", self._node_id,
                         ack.request_id, ack.epoch)
            return
        if not handoff.ack.done():
            handoff.ack.set_result(ack)

    def _lost(self, target: str, link: Link) -> None:
        logger.info("%s: link to decode node %s closed", self._node_id, target)
        for handoff in [h for h in self._waiting.values() if h.target == target]:
            handoff.fail(TargetLost(f"decode node {target} went away mid-handoff"))

    async def cancel_on_target(self, handoff: OutgoingHandoff, reason: str) -> None:
        """Tell the decode node to drop a handoff whose begin went out."""
        links = [link for link in self._links.get(handoff.target, []) if not link.closed]
        if not handoff.began or not links:
            return
        with contextlib.suppress(LinkClosed):
            await links[0].send(Cancel(handoff.header.request_id, reason).to_frame())

    async def close(self) -> None:
        for links in self._links.values():
            for link in links:
                await link.close()
        for task in list(self._readers):
            task.cancel()
