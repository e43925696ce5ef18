"""KV handoff throughput end to end vs raw loopback TCP, between the same two processes.

One handoff = the sender's transfer strategy (KVWriter: slicing + crc32) →
link frames (AES-256-GCM, bulk channel) → the receiver's KVAssembler (bodies
decrypted straight into MLX arrays' memory, ``kv_convert.kv_buffers`` + crc32
check) → ``mx.array`` per layer, as the decode node does it: the MLX engine's
``adopt_layer`` as each layer completes, then everything evaluated. The clock
runs from the strategy's ``start`` to the receiver's KV_ACK, sent once the MLX
arrays of every layer exist. Each repeat alternates every path so all see the
same machine load, with a raw TCP run just before each path's run. The ratio
is of median times (raw TCP's median over all its runs); "paired" is the
median of each run's ratio to the raw run just before it. An unrecorded
warm-up repeat comes first. Both processes also report their CPU
seconds and minor page faults per handoff, and the CPU of their event-loop
thread (framing, KV bookkeeping, sender crc32) apart from their bulk channel
threads (AES, socket copies, receiver crc32): on 2 cores the CPU sum, not any
one phase, bounds wall time, and link bytes beside the KV paths shows what the
KV layer adds to each.

Paths (sender = this process, receiver = one spawned process for all of them):

* raw TCP: ``sendall`` of the cache's bytes, receiver ``recv_into`` a reused buffer
* link bytes: the same bytes in KV_CHUNK frames of whole tensors up to 16 MiB
  (as the KV path frames them), no KV serde, decrypted into one reused buffer
  (separates the link's cost from the KV layer's)
* full / streamed / layer-parallel xN: the whole KV path above

The cache is synthetic, shaped like SmolLM2-135M's (30 layers x 3 KV heads x
64 head dim), Gaussian noise, T chosen so K+V reach the size. Receiver-side
phase times (assembler feed incl. per-layer adoption, final feed, the last
mx.eval) come back in the ack; they locate the KV path's own costs.

Usage: python loadtests/bench_kv_handoff.py [--quick] [--json PATH] [--sizes 64,256]
       [--dtypes float32,float16] [--repeats 5] [--lanes 2,4]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import resource
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench_common import add_common_args, bench_result, table, write_json

from engines import kv_convert
from engines.engine_memory import EngineMemory
from engines.unfilled import SlabCarver
from mlxcel_plugin.builtin_plugin import builtin_codecs
from mlxcel_plugin.engine_api import CacheLayer, CacheState, EngineConfig
from mlxcel_plugin.gc_pauses import freeze_startup_heap
from mlxcel_plugin.kv_serde import (
    HandoffHeader,
    KVAssembler,
    ModelFingerprint,
    ReceiveMemory,
    SerializableCacheState,
)
from mlxcel_plugin.link import Link, LinkConfig, dial_link, serve_links
from mlxcel_plugin.link.bulk import BULK_IN_THREAD, BULK_OUT_THREAD, SOCKET_BUFFER_BYTES
from mlxcel_plugin.link.protocol.frames import BodyParts, Frame, FrameType, kv_frame
from mlxcel_plugin.nodes.handoff_sender import OutgoingHandoff
from mlxcel_plugin.nodes.kv_wire import (
    FRAME_CHUNK_BYTES,
    chunk_destinations,
    end_first_token,
    frame_to_messages,
)
from mlxcel_plugin.nodes.outbox import Outbox
from mlxcel_plugin.testing.caches import make_cache, make_fingerprint, make_header
from mlxcel_plugin.transfer import (
    FullTransfer,
    LayerParallelTransfer,
    StreamedTransfer,
    TransferStrategy,
    make_strategy,
)

MIB = 1 << 20
SECRET = bytes(range(32))  # fixed: the spawned receiver re-imports this module
LOOPBACK = "127.0.0.1"
ACK_TIMEOUT_S = 120.0
_LEN = struct.Struct(">Q")
STRATEGIES = {s.name: s for s in (FullTransfer, StreamedTransfer, LayerParallelTransfer)}
FULL, STREAMED, LAYER_PARALLEL = STRATEGIES
CODECS = builtin_codecs()


# ---------------------------------------------------------------- receiver process


@dataclass
class AdoptTimer:
    """The MLX engine's ``adopt_layer``, timed, per layer as it completes (a copy into MLX
    unless the layer was received into MLX memory)."""

    seconds: float = 0.0

    def adopt(self, layer: CacheLayer) -> CacheLayer:
        start = time.perf_counter()
        adopted = kv_convert.adopt_layer(layer)
        self.seconds += time.perf_counter() - start
        return adopted


@dataclass
class _Ingest:
    assembler: KVAssembler
    started_s: float
    started_cpu_s: float
    started_faults: int
    started_threads: dict[str, float]
    adopter: AdoptTimer
    feed_s: float = 0.0
    first_token: int | None = None  # from KV_END, when the sender put it there


@dataclass
class KVSink:
    """Receives KV frames of any number of handoffs on any lanes; returns finished caches.

    The local fingerprint is taken from the first begin (this receiver serves
    whichever model the sender has; a decode node would check its own). Like
    the decode node's HandoffReceiver on the MLX engine, layer buffers are MLX
    arrays' memory (``make_buffers``), raw chunk bodies are decrypted in place
    (``body_destination`` is the links' body sink), and each whole layer is
    adopted as MLX arrays while the next ones arrive.
    """

    make_buffers: Callable[[tuple[int, ...], Any, int], Any]
    codecs: Mapping[str, Any] = field(default_factory=builtin_codecs)
    ingests: dict[str, _Ingest] = field(default_factory=dict)
    scratch: bytearray = field(default_factory=bytearray)
    bytes_received: int = 0  # link-bytes path: body bytes since the last ack
    bytes_threads: dict[str, float] = field(default_factory=dict)  # ... and thread CPU then

    def body_destination(self, frame_type: FrameType, header: dict, n_bytes: int) -> Any:
        if header.get("bytes_only"):
            # Link bytes are counted, not kept: one warm buffer, as the KV path's are warm.
            if len(self.scratch) < n_bytes:
                self.scratch = bytearray(n_bytes)
            return memoryview(self.scratch)[:n_bytes]
        ingest = self.ingests.get(str(header.get("handoff_id")))
        if frame_type is not FrameType.KV_CHUNK or ingest is None:
            return None
        return chunk_destinations(ingest.assembler.chunk_destination, header, n_bytes)

    def feed(self, frame: Frame) -> tuple[str, SerializableCacheState, dict[str, float]] | None:
        handoff_id = str(frame.header["handoff_id"])
        messages = frame_to_messages(frame)
        ingest = self.ingests.get(handoff_id)
        if ingest is None:
            fingerprint = HandoffHeader.from_message(messages[0]).fingerprint
            timer = AdoptTimer()
            assembler = KVAssembler(
                fingerprint,
                self.codecs,
                memory=ReceiveMemory(make_buffers=self.make_buffers),
                adopt=timer.adopt,
            )
            ingest = _Ingest(
                assembler,
                time.perf_counter(),
                time.process_time(),
                page_faults(),
                thread_cpu_s(),
                timer,
            )
            self.ingests[handoff_id] = ingest
        start, state = time.perf_counter(), None
        for message in messages:
            state = ingest.assembler.feed(message)
        elapsed = time.perf_counter() - start
        ingest.feed_s += elapsed
        if frame.type is FrameType.KV_END:
            ingest.first_token = end_first_token(frame)
        if state is None:
            return None
        del self.ingests[handoff_id]
        first = state.header.first_token if ingest.first_token is None else ingest.first_token
        phases = {
            "feed_s": ingest.feed_s,
            "adopt_s": ingest.adopter.seconds,
            "complete_s": elapsed,
            "receive_s": time.perf_counter() - ingest.started_s,
            "started_cpu_s": ingest.started_cpu_s,
            "started_faults": ingest.started_faults,
            "first_token": first,
            **thread_cpu_phases("recv", ingest.started_threads),
        }
        return handoff_id, state, phases


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds so far of this process's event-loop thread and of its bulk channel threads."""
    if not hasattr(time, "pthread_getcpuclockid"):  # no per-thread clocks here (macOS)
        return {}
    totals = {"loop": 0.0, "bulk": 0.0}
    for thread in threading.enumerate():
        if thread is threading.main_thread():
            role = "loop"
        elif thread.name.startswith((BULK_IN_THREAD, BULK_OUT_THREAD)):
            role = "bulk"
        else:
            continue
        try:
            totals[role] += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except OSError:  # the thread ended meanwhile
            continue
    return totals


def thread_cpu_phases(side: str, started: dict[str, float]) -> dict[str, float]:
    """``{side}_loop_cpu_s`` and ``{side}_bulk_cpu_s`` since ``started`` (a ``thread_cpu_s``)."""
    now = thread_cpu_s()
    return {f"{side}_{role}_cpu_s": now[role] - started[role] for role in started}


def page_faults() -> int:
    """Minor page faults of this process so far: fresh memory costs ~2 ms per MiB here."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def to_mlx(cache: CacheState) -> list[tuple[Any, Any]]:
    """The end of the decode node's deserialization: every tensor an evaluated ``mx.array``.

    Layers were adopted (copied into MLX) as they completed; converting any
    that were not keeps the measured span honest either way.
    """
    import mlx.core as mx

    layers = [layer if _is_mlx(layer) else kv_convert.adopt_layer(layer) for layer in cache.layers]
    arrays = [(layer.keys, layer.values) for layer in layers]
    mx.eval(arrays)
    return arrays


def _is_mlx(layer: Any) -> bool:
    import mlx.core as mx

    return isinstance(layer.keys, mx.array) and isinstance(layer.values, mx.array)


async def _serve_kv_link(link: Link, sink: KVSink) -> None:
    """Assemble handoffs off this link; ack each on the link that completed it.

    Like the decode node: frames are handled on the link's reader task
    (``deliver_to``), so a begin is applied before its first chunk is placed.
    """
    outbox = Outbox(link)
    link.set_body_sink(sink.body_destination)
    link.deliver_to(lambda frame: _on_kv_frame(frame, sink, outbox))
    try:
        await link.wait_closed()  # until the sender closes the link
    finally:
        outbox.close()


def _on_kv_frame(frame: Frame, sink: KVSink, outbox: Outbox) -> None:
    if frame.type is FrameType.KV_CHUNK and frame.header.get("bytes_only"):
        if not sink.bytes_received:
            sink.bytes_threads = thread_cpu_s()
        sink.bytes_received += len(frame.body)
        if frame.header.get("last"):
            ack = {"bytes": sink.bytes_received, **thread_cpu_phases("recv", sink.bytes_threads)}
            outbox.put(kv_frame(FrameType.KV_ACK, ack))
            sink.bytes_received = 0
        return
    if frame.type not in (FrameType.KV_BEGIN, FrameType.KV_CHUNK, FrameType.KV_END):
        return
    done = sink.feed(frame)
    if done is None:
        return
    handoff_id, state, phases = done
    start = time.perf_counter()
    to_mlx(state.cache)
    phases["mlx_s"] = time.perf_counter() - start
    phases["cpu_s"] = time.process_time() - phases.pop("started_cpu_s")
    phases["faults"] = page_faults() - phases.pop("started_faults")
    del state, done  # the receive arrays are released, as after engine.decode
    outbox.put(kv_frame(FrameType.KV_ACK, {"handoff_id": handoff_id, **phases}))


def _raw_server(listener: socket.socket) -> None:
    """Raw TCP ceiling: a length, then that many bytes into a reused buffer, then one ack byte."""
    buffer = bytearray()
    while True:  # one connection per measurement; ends when the listener closes
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            tune_socket(conn)
            _serve_raw_conn(conn, buffer)


def _serve_raw_conn(conn: socket.socket, buffer: bytearray) -> None:
    header = bytearray(_LEN.size)
    while _recv_into(conn, memoryview(header)):  # until the sender closes
        (size,) = _LEN.unpack(header)
        if len(buffer) < size:
            buffer.extend(bytes(size - len(buffer)))
        if not _recv_into(conn, memoryview(buffer)[:size]):
            return
        conn.sendall(b"k")


def _recv_into(conn: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):  # bounded: each pass reads >= 1 byte or returns
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def receiver_main(port_q: Any) -> None:
    """Entry point of the receiving process (raw TCP listener + link server)."""
    import mlx.core as mx

    # MLX keeps freed buffers up to the receive pool's bound, as a decode node's engine does
    # (EngineMemory.apply): without it MLX's own 32 MiB default sent every handoff into
    # fresh pages, faulted as the bodies were decrypted.
    EngineMemory(0, EngineConfig()).apply()
    listener = socket.create_server((LOOPBACK, 0))
    threading.Thread(target=_raw_server, args=(listener,), daemon=True).start()
    carver = SlabCarver(mx.new_stream(mx.cpu))  # as MlxEngine.kv_buffers: K/V in MLX memory
    sink = KVSink(lambda shape, dtype, count: kv_convert.kv_buffers(shape, dtype, count, carver))
    freeze_startup_heap()  # as a node does before serving

    async def main() -> None:
        server = await serve_links(
            f"{LOOPBACK}:0",
            SECRET,
            "decode",
            "bench-decode",
            {"prefill"},
            lambda link: _serve_kv_link(link, sink),
            config=bench_link_config(),
        )
        port_q.put((listener.getsockname()[1], server.port))
        await asyncio.sleep(3600)  # the parent terminates us

    asyncio.run(main())


def bench_link_config() -> LinkConfig:
    # Keepalive pings off: a ping answered late under load must not close a busy link.
    return LinkConfig(ping_interval_s=None, ping_timeout_s=None)


# ---------------------------------------------------------------- sender side


@dataclass
class Peer:
    """The sender's end: a raw TCP address and links (lane i = links[i]) to one receiver."""

    process: mp.process.BaseProcess
    raw_port: int
    link_port: int
    raw: socket.socket | None = None
    links: list[Link] = field(default_factory=list)
    acks: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)
    readers: list[asyncio.Task[None]] = field(default_factory=list)

    async def ensure_links(self, count: int) -> list[Link]:
        while len(self.links) < count:  # one dial per missing lane
            link = await dial_link(
                f"{LOOPBACK}:{self.link_port}",
                SECRET,
                "prefill",
                "bench-prefill",
                config=bench_link_config(),
            )
            self.links.append(link)
            self.readers.append(asyncio.create_task(self._read_acks(link)))
        return self.links[:count]

    async def _read_acks(self, link: Link) -> None:
        async for frame in link:  # until the link closes
            if frame.type is FrameType.KV_ACK:
                self.acks.put_nowait(frame.header)

    async def next_ack(self) -> dict[str, Any]:
        return await asyncio.wait_for(self.acks.get(), ACK_TIMEOUT_S)

    def raw_conn(self) -> socket.socket:
        if self.raw is None:
            self.raw = raw_connect(self.raw_port)
        return self.raw

    async def close(self) -> None:
        if self.raw is not None:
            self.raw.close()
        for link in self.links:
            await link.close()
        for task in self.readers:
            task.cancel()
        self.process.terminate()
        self.process.join(timeout=10)


def start_peer() -> Peer:
    port_q: mp.Queue = mp.get_context("spawn").Queue()
    process = mp.get_context("spawn").Process(target=receiver_main, args=(port_q,), daemon=True)
    process.start()
    raw_port, link_port = port_q.get(timeout=120)
    return Peer(process, raw_port, link_port)


def tensor_views(cache: CacheState) -> list[memoryview]:
    return [memoryview(t).cast("B") for layer in cache.layers for t in (layer.keys, layer.values)]


def raw_connect(port: int) -> socket.socket:
    """One long-lived connection, tuned like the link's bulk channel (same ceiling)."""
    conn = socket.create_connection((LOOPBACK, port))
    tune_socket(conn)
    return conn


def tune_socket(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def raw_tcp_once(conn: socket.socket, views: Sequence[memoryview]) -> float:
    """Seconds to push the cache's bytes over the raw connection and get the ack."""
    start = time.perf_counter()
    conn.sendall(_LEN.pack(sum(len(v) for v in views)))
    for view in views:
        conn.sendall(view)
    if conn.recv(1) != b"k":
        raise RuntimeError("raw receiver did not ack")
    return time.perf_counter() - start


async def link_bytes_once(
    peer: Peer, views: Sequence[memoryview]
) -> tuple[float, dict[str, float]]:
    """The link alone: the same bytes framed as the KV path frames them, no KV serde.

    Returns the seconds and both ends' thread CPU (as the KV paths' phases name it).
    """
    (link,) = await peer.ensure_links(1)
    frames = list(_byte_frames(views, FRAME_CHUNK_BYTES))
    start, start_threads = time.perf_counter(), thread_cpu_s()
    for i, parts in enumerate(frames):
        header = {"bytes_only": True, "last": i == len(frames) - 1}
        await link.send(kv_frame(FrameType.KV_CHUNK, header, BodyParts(parts)))
    ack = await peer.next_ack()
    elapsed = time.perf_counter() - start
    cpu = {k: float(v) for k, v in ack.items() if k.endswith("_cpu_s")}
    return elapsed, {**thread_cpu_phases("send", start_threads), **cpu}


def _byte_frames(views: Sequence[memoryview], frame_bytes: int) -> Iterator[list[memoryview]]:
    """Consecutive whole views (tensors) up to ``frame_bytes`` per frame, as ``frames_for``."""
    parts: list[memoryview] = []
    held = 0
    for view in views:
        if parts and held + len(view) > frame_bytes:
            yield parts
            parts, held = [], 0
        parts.append(view)
        held += len(view)
    if parts:
        yield parts


@dataclass
class HandoffTiming:
    total_s: float
    plan_s: float  # sender CPU in the strategy (slicing, crc32, codec)
    cpu_s: float  # sender process CPU seconds (all threads) over the handoff
    receiver: dict[str, Any]


class HandoffSender:
    """Drives one strategy over the peer's lanes as the prefill node does (``OutgoingHandoff``),
    timing the sender's own work in the strategy."""

    def __init__(self, strategy: TransferStrategy, lanes: Sequence[Link]):
        self.strategy, self.lanes = strategy, list(lanes)
        self.plan_s = 0.0
        self.handoff: OutgoingHandoff | None = None

    def _plan(self, step: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = step()
        self.plan_s += time.perf_counter() - start
        return result

    async def start(self, header: HandoffHeader) -> None:
        handoff = OutgoingHandoff(header, self.strategy, "bench-decode")
        self.handoff = handoff
        handoff.push(self._plan(lambda: self.strategy.start(header)))
        handoff.run(asyncio.create_task(_ready(self.lanes)))

    async def add_layer(self, index: int, layer: Any) -> None:
        self._plan(lambda: self._live().add_layer(index, layer))
        # One layer per loop turn, as the engine thread's on_layer callbacks arrive.
        await asyncio.sleep(0)

    async def finish(self, first_token: int = 0) -> None:
        self._plan(lambda: self._live().finish(first_token))

    async def acked(self, peer: Peer) -> dict[str, Any]:
        """The receiver's ack, or the send failure (the handoff's ``ack`` only fails here)."""
        failed = self._live().ack
        ack = asyncio.ensure_future(peer.next_ack())
        await asyncio.wait({ack, failed}, return_when=asyncio.FIRST_COMPLETED)
        if failed.done():
            ack.cancel()
            failed.result()  # raises why the handoff could not be sent
        return ack.result()

    def _live(self) -> OutgoingHandoff:
        if self.handoff is None:
            raise RuntimeError("start() first")
        return self.handoff


async def _ready(lanes: list[Link]) -> list[Link]:
    return lanes


def new_strategy(name: str, codec: str, lanes: int) -> TransferStrategy:
    return make_strategy(name, codec, STRATEGIES, CODECS, lanes=lanes)


async def handoff_once(
    peer: Peer, name: str, lanes: int, header: HandoffHeader, cache: CacheState, codec: str = "none"
) -> HandoffTiming:
    links = await peer.ensure_links(lanes)
    start, start_cpu, start_faults = time.perf_counter(), time.process_time(), page_faults()
    start_threads = thread_cpu_s()
    sender = HandoffSender(new_strategy(name, codec, lanes), links)
    await sender.start(header)
    for index, layer in enumerate(cache.layers):
        await sender.add_layer(index, layer)
    await sender.finish()
    ack = await sender.acked(peer)
    if ack.get("handoff_id") != header.handoff_id:
        raise RuntimeError(f"ack for {ack.get('handoff_id')}, expected {header.handoff_id}")
    elapsed, cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    ack["sender_faults"] = page_faults() - start_faults
    ack.update(thread_cpu_phases("send", start_threads))
    return HandoffTiming(elapsed, sender.plan_s, cpu_s, ack)


# ---------------------------------------------------------------- measurement


@dataclass(frozen=True)
class Route:
    label: str
    strategy: str | None  # None: a baseline (raw TCP or link bytes)
    lanes: int = 1


def paths_for(lanes: Sequence[int]) -> list[Route]:
    paths = [
        Route("raw TCP", None),
        Route("link bytes", None),
        Route("full", FULL),
        Route("streamed", STREAMED),
    ]
    paths += [Route(f"layer-parallel x{n}", LAYER_PARALLEL, n) for n in lanes]
    return paths


def synthetic_cache(dtype: str, size_mib: int) -> tuple[ModelFingerprint, CacheState]:
    fingerprint = make_fingerprint(30, 3, 64, dtype)
    per_token = fingerprint.num_layers * 2 * fingerprint.tensor_bytes(1)
    tokens = size_mib * MIB // per_token
    return fingerprint, make_cache(fingerprint, tokens, seed=1)


@dataclass
class Samples:
    seconds: dict[str, list[float]] = field(default_factory=dict)
    ratios: dict[str, list[float]] = field(default_factory=dict)
    phases: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    recording: bool = True

    def add(self, label: str, seconds: float, raw_s: float, phases: dict[str, float]) -> None:
        if not self.recording:
            return
        self.seconds.setdefault(label, []).append(seconds)
        self.ratios.setdefault(label, []).append(raw_s / seconds)
        self.phases.setdefault(label, []).append(phases)


async def measure_case(
    peer: Peer, dtype: str, size_mib: int, paths: Sequence[Route], repeats: int
) -> tuple[int, Samples]:
    fingerprint, cache = synthetic_cache(dtype, size_mib)
    tokens = cache.layers[0].offset
    views = tensor_views(cache)
    samples = Samples()
    # Repeat 0 warms up and is not recorded: a serving decode node has faulted in its
    # allocators' pages (numpy pool, MLX) long before; first-touch page faults are not
    # what a handoff costs in steady state.
    for repeat in range(repeats + 1):
        samples.recording = repeat > 0
        for path in paths[1:]:
            raw_s = raw_tcp_once(peer.raw_conn(), views)  # this path's own baseline
            samples.add("raw TCP", raw_s, raw_s, {})
            if path.strategy is None:
                seconds, cpu = await link_bytes_once(peer, views)
                samples.add(path.label, seconds, raw_s, cpu)
                continue
            header = make_header(
                fingerprint, tokens, handoff_id=f"{dtype}-{size_mib}-{path.label}-{repeat}"
            )
            timing = await handoff_once(peer, path.strategy, path.lanes, header, cache)
            phases = {
                "plan_s": timing.plan_s,
                "sender_cpu_s": timing.cpu_s,
                **{k: float(v) for k, v in timing.receiver.items() if k.endswith("_s")},
                "send_faults": timing.receiver["sender_faults"],
                "recv_faults": timing.receiver["faults"],
            }
            samples.add(path.label, timing.total_s, raw_s, phases)
    return cache.nbytes, samples


FAULT_KEYS = ("send_faults", "recv_faults")
PHASE_KEYS = (
    "plan_s",
    "feed_s",
    "adopt_s",
    "complete_s",
    "mlx_s",
    "receive_s",
    "sender_cpu_s",
    "cpu_s",
    "send_loop_cpu_s",
    "send_bulk_cpu_s",
    "recv_loop_cpu_s",
    "recv_bulk_cpu_s",
)


def median_phase(phases: list[dict[str, float]], key: str) -> float:
    values = [p[key] for p in phases if key in p]
    return statistics.median(values) if values else float("nan")


def _whole(value: float) -> int | None:
    return round(value) if math.isfinite(value) else None  # None: not measured on this path


def result_rows(
    dtype: str,
    size_mib: int,
    nbytes: int,
    samples: Samples,
) -> tuple[list[list[Any]], list[list[Any]]]:
    rows, phase_rows = [], []
    raw_median_s = statistics.median(samples.seconds["raw TCP"])
    for label, seconds in samples.seconds.items():
        rate = nbytes / statistics.median(seconds) / MIB
        ratio = raw_median_s / statistics.median(seconds)
        paired = statistics.median(samples.ratios[label])
        rows.append([dtype, size_mib, label, round(rate), round(ratio, 2), round(paired, 2)])
        phases = samples.phases[label]
        if phases and phases[0]:
            phase_rows.append(
                [dtype, size_mib, label]
                + [round(1000 * median_phase(phases, key), 1) for key in PHASE_KEYS]
                + [round(1000 * statistics.median(seconds), 1)]
                + [_whole(median_phase(phases, key)) for key in FAULT_KEYS]
            )
    return rows, phase_rows


def print_rows(rows: list[list[Any]]) -> None:
    for row in rows:
        print(
            f"{row[0]:>8} {row[1]:>5}Mi {row[2]:>20} {row[3]:>8} MiB/s {row[4]:>6.2f}x raw"
            f" {row[5]:>6.2f}x paired",
            flush=True,
        )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [64] if args.quick else [int(s) for s in args.sizes.split(",")]
    dtypes = ["float16"] if args.quick else args.dtypes.split(",")
    repeats = 4 if args.quick else args.repeats
    paths = paths_for([int(n) for n in args.lanes.split(",")])
    peer = start_peer()
    freeze_startup_heap()  # as the prefill node does before serving
    rows: list[list[Any]] = []
    phase_rows: list[list[Any]] = []
    series: dict[str, list[float]] = {}
    try:
        for dtype in dtypes:
            for size_mib in sizes:
                nbytes, samples = await measure_case(peer, dtype, size_mib, paths, repeats)
                case_rows, case_phases = result_rows(dtype, size_mib, nbytes, samples)
                print_rows(case_rows)
                rows += case_rows
                phase_rows += case_phases
                for row in case_rows:
                    series.setdefault(f"ratio_{row[2]}", []).append(row[4])
    finally:
        await peer.close()
    return {"rows": rows, "phase_rows": phase_rows, "series": series, "repeats": repeats}


def main() -> None:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--sizes", default="64,256", help="cache sizes in MiB")
    parser.add_argument("--dtypes", default="float32,float16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lanes", default="2,4", help="link counts for layer-parallel")
    args = parser.parse_args()
    print(
        f"{'dtype':>8} {'size':>7} {'path':>20} {'throughput':>14} {'vs raw TCP':>10}"
        "  (ratio of median times; paired = median of ratios to the raw run just before)",
        flush=True,
    )
    out = asyncio.run(run(args))
    for row in out["phase_rows"]:
        print("phases ms", row, flush=True)
    tables = [
        table(
            f"KV handoff end to end vs raw loopback TCP (same two processes; median of "
            f"{out['repeats']}; x raw TCP = ratio of median times; paired = median ratio "
            "to the raw TCP run just before each)",
            ["dtype", "MiB", "path", "MiB/s", "x raw TCP", "paired"],
            out["rows"],
        ),
        table(
            "Phase times, ms (median): sender strategy CPU; receiver assembler feed "
            "(all frames), of which per-layer mx.array, last feed, final mx.eval; receiver "
            "first-to-last frame; CPU of the sender and receiver processes, and of each one's "
            "event-loop thread and bulk channel threads; minor page faults per handoff",
            [
                "dtype",
                "MiB",
                "path",
                "plan",
                "feed",
                "of which mx.array",
                "last feed",
                "mx.eval",
                "receive",
                "send CPU",
                "recv CPU",
                "send loop",
                "send bulk",
                "recv loop",
                "recv bulk",
                "total",
                "send faults",
                "recv faults",
            ],
            out["phase_rows"],
        ),
    ]
    if args.json:
        write_json(args.json, bench_result("kv_handoff", tables, out["series"]))


if __name__ == "__main__":
    main()
