"""OutgoingHandoff: lanes send in order, a stalled lane holds up only itself, the encoder
thread runs the strategy off the event loop."""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import astuple

import pytest

from mlxcel_plugin.builtin_plugin import builtin_codecs
from mlxcel_plugin.errors import HandoffError
from mlxcel_plugin.kv_codecs import CodecError
from mlxcel_plugin.kv_serde import assemble_messages
from mlxcel_plugin.link import LinkClosed
from mlxcel_plugin.link.protocol.frames import FrameType
from mlxcel_plugin.link.tcp_chrono import TcpChrono
from mlxcel_plugin.nodes import handoff_sender
from mlxcel_plugin.nodes.handoff_sender import OutgoingHandoff, TargetLost
from mlxcel_plugin.nodes.kv_wire import frame_to_messages
from mlxcel_plugin.testing.caches import (
    assert_caches_equal,
    make_cache,
    make_fingerprint,
    make_header,
)
from mlxcel_plugin.transfer import (
    FullTransfer,
    LayerParallelTransfer,
    StrategyOptions,
    StreamedTransfer,
)


class FakeLane:
    """A link's send side: records frames; ``stall`` makes it full until released."""

    def __init__(self, stall: bool = False, fail: bool = False, room: int = 0):
        self.frames = []
        self.released = asyncio.Event()
        self.fail, self.room = fail, room  # room: frames it takes before it is full
        self.queued_bytes = 0  # taken, not yet on the socket
        self.chronos = ()  # its connections' kernel clocks (none: no clock)
        self.bulk_lanes = 0  # no bulk channel: bodies travel in its records
        if not stall:
            self.released.set()

    def body_tcp_chronos(self):
        return self.chronos

    def try_send(self, frame):
        if not self.released.is_set() and len(self.frames) >= self.room:
            return False  # its send queue is full
        self._take(frame)
        return True

    async def send(self, frame):
        await self.released.wait()
        self._take(frame)

    def _take(self, frame):
        if self.fail:
            raise LinkClosed("link to decode-1 is closed: reset")
        self.frames.append(frame)

    def chunk_layers(self):
        return [m.header["layer"] for f in self.frames if f.type is FrameType.KV_CHUNK
                for m in frame_to_messages(f)]


def start_handoff(lanes):
    fingerprint = make_fingerprint(num_layers=6)
    cache = make_cache(fingerprint, 40, seed=3)
    strategy = LayerParallelTransfer(StrategyOptions(lanes=len(lanes)))
    handoff = OutgoingHandoff(make_header(fingerprint, 40), strategy, "decode-1")
    handoff.push(strategy.start(handoff.header))

    async def ready():
        return lanes

    handoff.run(asyncio.ensure_future(ready()))
    for index, layer in enumerate(cache.layers):
        handoff.add_layer(index, layer)
    handoff.finish(first_token=7)
    return handoff


async def settle():
    for _ in range(50):  # bounded: lets the send tasks run their course
        await asyncio.sleep(0)


def test_a_stalled_lane_does_not_hold_up_the_others_and_each_lane_keeps_its_order():
    async def scenario():
        stalled, free = FakeLane(stall=True), FakeLane()
        handoff = start_handoff([stalled, free])
        await settle()
        # Layers are dealt round-robin: lane 1 carries the odd ones, all sent already.
        assert free.frames[0].type is FrameType.KV_BEGIN
        assert free.chunk_layers() == [1, 1, 3, 3, 5, 5]  # K and V
        assert stalled.frames == []
        moved_s = handoff.progressed_s  # the free lane's frames moved it
        assert moved_s > handoff.started_s
        stalled.released.set()
        await settle()
        assert handoff.progressed_s > moved_s  # and the stalled lane's, once released
        kinds = [f.type for f in stalled.frames]
        assert kinds[0] is FrameType.KV_BEGIN and kinds[-1] is FrameType.KV_END
        assert stalled.chunk_layers() == [0, 0, 2, 2, 4, 4]
        assert stalled.frames[-1].header["first_token"] == 7
        assert handoff.began and handoff.sent_bytes > 0 and not handoff.ack.done()

    asyncio.run(scenario())


def test_the_link_is_measured_over_the_faster_of_two_windows():
    async def scenario():
        fingerprint = make_fingerprint(num_layers=4)
        cache = make_cache(fingerprint, 40, seed=3)
        strategy = LayerParallelTransfer(StrategyOptions(lanes=1))
        handoff = OutgoingHandoff(make_header(fingerprint, 40), strategy, "decode-1")
        handoff.push(strategy.start(handoff.header))
        lane = FakeLane()
        lane.chronos = (TcpChrono(1.0, 0.0), TcpChrono(5.0, 0.0))  # two connections

        async def ready():
            return [lane]

        handoff.run(asyncio.ensure_future(ready()))
        for index, layer in enumerate(cache.layers[:3]):  # streamed while prefill runs
            handoff.add_layer(index, layer)
        await settle()
        during_prefill = handoff.sent_bytes
        lane.queued_bytes = 1000  # of those, still in the link when prefill ends
        lane.chronos = (TcpChrono(2.0, 0.0), TcpChrono(5.0, 0.0))
        handoff.add_layer(3, cache.layers[3])
        handoff.finish(first_token=7)
        await settle()
        assert 0 < during_prefill == handoff.sent_by_finish_bytes < handoff.sent_bytes
        # Chunks came slowly during prefill: the window after it is the faster one.
        # Each window carries what its busiest connection did in it (the first, here).
        lane.chronos = (TcpChrono(2.4, 0.1), TcpChrono(5.1, 0.0))
        handoff.first_chunk_s = handoff.finished_s - 10.0
        after = handoff.link_sample(handoff.finished_s + 0.5)
        assert after.nbytes == handoff.sent_bytes - during_prefill + 1000
        assert after.seconds == pytest.approx(0.5)
        assert astuple(after.chrono) == pytest.approx((0.4, 0.1))
        # The link was the bottleneck from the first chunk on: every byte over that window.
        handoff.first_chunk_s = handoff.finished_s - 0.01
        whole = handoff.link_sample(handoff.finished_s + 0.5)
        assert whole.nbytes == handoff.sent_bytes and whole.seconds == pytest.approx(0.51)
        assert astuple(whole.chrono) == pytest.approx((1.4, 0.1))
        # Cells' rows went ahead at prefill's pace: only the window after prefill counts.
        handoff.chunks_ahead = 3
        assert handoff.link_sample(handoff.finished_s + 0.5).nbytes == after.nbytes
        lane.chronos = (None, TcpChrono(5.1, 0.0))  # a connection without a clock: none
        assert handoff.link_sample(handoff.finished_s + 0.5).chrono is None

    asyncio.run(scenario())


def test_a_lane_that_fails_fails_the_handoff_and_stops_the_other_lanes():
    async def scenario():
        stalled, broken = FakeLane(stall=True), FakeLane(fail=True)
        handoff = start_handoff([stalled, broken])
        with pytest.raises(TargetLost, match="decode-1 unreachable"):
            await asyncio.wait_for(handoff.ack, 1)
        stalled.released.set()
        await settle()
        assert stalled.frames == [] and broken.frames == []  # nothing more went out

    asyncio.run(scenario())


def test_a_lane_that_fills_up_midway_still_sends_its_frames_in_order():
    async def scenario():
        filling, free = FakeLane(stall=True, room=2), FakeLane()
        start_handoff([filling, free])
        await settle()
        assert [f.type for f in filling.frames] == [FrameType.KV_BEGIN, FrameType.KV_CHUNK]
        assert free.chunk_layers() == [1, 1, 3, 3, 5, 5]
        filling.released.set()
        await settle()
        assert filling.chunk_layers() == [0, 0, 2, 2, 4, 4]
        assert filling.frames[-1].type is FrameType.KV_END

    asyncio.run(scenario())


class RecordingStrategy(LayerParallelTransfer):
    """Records which thread each call ran on; ``fail_at`` raises on that layer."""

    def __init__(self, options, fail_at=None, error=None):
        super().__init__(options)
        self.threads, self.encoded, self.fail_at, self.error = [], [], fail_at, error

    def add_layer(self, index, layer):
        self.threads.append(threading.get_ident())
        if index == self.fail_at:
            raise self.error
        self.encoded.append(index)
        return super().add_layer(index, layer)

    def finish(self):
        self.threads.append(threading.get_ident())
        return super().finish()


def encoded_handoff(encoder, lane, **strategy_kwargs):
    fingerprint = make_fingerprint(num_layers=6)
    cache = make_cache(fingerprint, 40, seed=3)
    strategy = RecordingStrategy(StrategyOptions(lanes=1), **strategy_kwargs)
    handoff = OutgoingHandoff(make_header(fingerprint, 40), strategy, "decode-1", encoder=encoder)
    handoff.push(strategy.start(handoff.header))

    async def ready():
        return [lane]

    handoff.run(asyncio.ensure_future(ready()))
    return handoff, cache, strategy


async def until(condition, timeout_s=5.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():  # bounded by the deadline
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_the_encoder_thread_runs_the_strategy_and_the_frames_keep_their_order():
    async def scenario():
        lane = FakeLane()
        with ThreadPoolExecutor(1) as encoder:
            handoff, cache, strategy = encoded_handoff(encoder, lane)
            for index, layer in enumerate(cache.layers):
                handoff.add_layer(index, layer)
            handoff.finish(first_token=7)
            await until(lambda: lane.frames and lane.frames[-1].type is FrameType.KV_END)
        loop_thread = threading.get_ident()
        assert strategy.threads and loop_thread not in strategy.threads
        assert lane.frames[0].type is FrameType.KV_BEGIN
        assert lane.chunk_layers() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
        assert lane.frames[-1].header["first_token"] == 7 and not handoff.ack.done()

    asyncio.run(scenario())


@pytest.mark.parametrize("error", [CodecError("int8: tensor holds inf/nan, cannot quantize"),
                                   ValueError("a plugin codec's own bug")])
def test_an_encoding_failure_on_the_encoder_fails_that_handoff_with_a_named_error(error):
    async def scenario():
        lane = FakeLane()
        with ThreadPoolExecutor(1) as encoder:
            handoff, cache, strategy = encoded_handoff(encoder, lane, fail_at=2, error=error)
            for index, layer in enumerate(cache.layers):
                handoff.add_layer(index, layer)
            handoff.finish(first_token=7)
            with pytest.raises(HandoffError) as raised:
                await asyncio.wait_for(handoff.ack, 5)
        assert raised.value.code == (error.code if isinstance(error, HandoffError)
                                     else "handoff_failed")
        assert strategy.encoded == [0, 1]  # nothing after the failure was encoded
        assert FrameType.KV_END not in [f.type for f in lane.frames]

    asyncio.run(scenario())


class GatedFull(FullTransfer):
    """A FullTransfer whose layer ``i`` waits for ``gates[i]`` where there is one (a slow
    codec, held back layer by layer)."""

    def __init__(self, options, gates):
        super().__init__(options)
        self.gates = gates

    def add_layer(self, index, layer):
        if index in self.gates:
            assert self.gates[index].wait(5)
        return super().add_layer(index, layer)


def test_full_sends_each_layer_as_it_is_encoded_once_the_prefill_has_ended():
    """The prefill ends while the encoder waits before layer 3 of 6: begin and layers 0-3 go out
    once layer 3 is encoded, while layer 4 still waits; the cache arrives whole and in order."""
    async def scenario():
        gates, lane = {3: threading.Event(), 4: threading.Event()}, FakeLane()
        fingerprint = make_fingerprint(num_layers=6)
        cache = make_cache(fingerprint, 40, seed=3)
        header = make_header(fingerprint, 40)
        strategy = GatedFull(StrategyOptions(), gates)
        with ThreadPoolExecutor(1) as encoder:
            handoff = OutgoingHandoff(header, strategy, "decode-1", encoder=encoder)
            handoff.push(strategy.start(header))

            async def ready():
                return [lane]

            handoff.run(asyncio.ensure_future(ready()))
            for index, layer in enumerate(cache.layers):
                handoff.add_layer(index, layer)
            handoff.finish(first_token=7)
            gates[3].set()
            await until(lambda: lane.chunk_layers()[-1:] == [3])
            assert lane.frames[0].type is FrameType.KV_BEGIN
            assert lane.chunk_layers() == [0, 0, 1, 1, 2, 2, 3, 3]
            gates[4].set()
            await until(lambda: lane.frames and lane.frames[-1].type is FrameType.KV_END)
        assert lane.chunk_layers() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
        messages = [m for frame in lane.frames for m in frame_to_messages(frame)]
        assert_caches_equal(assemble_messages(messages, fingerprint, builtin_codecs()).cache,
                            cache)

    asyncio.run(scenario())


def test_layers_queued_behind_a_refusal_are_not_encoded():
    async def scenario():
        gate = threading.Event()
        lane = FakeLane()
        with ThreadPoolExecutor(1) as encoder:
            handoff, cache, strategy = encoded_handoff(encoder, lane)
            encoder.submit(gate.wait, 5)  # the encoder is busy with another handoff
            for index, layer in enumerate(cache.layers):
                handoff.add_layer(index, layer)
            handoff.finish(first_token=7)
            handoff.fail(HandoffError("refused by the decode node", code="at_capacity"))
            gate.set()
        assert strategy.encoded == [] and strategy.threads == []

    asyncio.run(scenario())


def test_rows_stop_going_ahead_once_the_link_falls_behind_and_the_cache_still_arrives_whole(
        monkeypatch):
    """Over a link slower than prefill the rows' copies would pile up: past the backlog
    bound the rest of every layer goes with the layer, and the receiver gets the same cache."""
    monkeypatch.setattr(handoff_sender, "ROWS_BACKLOG_BYTES", 5_000)
    fingerprint = make_fingerprint(num_layers=3, kv_heads=2, head_dim=16, dtype="float16")
    cache = make_cache(fingerprint, 40, seed=4)
    cells = [(0, 10), (10, 20), (20, 30), (30, 39)]

    async def scenario():
        lane = FakeLane(stall=True)  # a link that takes nothing until released
        strategy = StreamedTransfer(StrategyOptions())
        handoff = OutgoingHandoff(make_header(fingerprint, 40), strategy, "decode-1")
        handoff.push(strategy.start(handoff.header))

        async def ready():
            return [lane]

        handoff.run(asyncio.ensure_future(ready()))
        taken = []
        for first, end in cells:  # each cell's rows of every layer, as prefill makes them
            for index, layer in enumerate(cache.layers):
                arrays = {"k": layer.keys[:, :, first:end].copy(),
                          "v": layer.values[:, :, first:end].copy()}
                handoff.add_rows(index, first, arrays)
                taken.append(not handoff.rows_stopped)
            await settle()
        assert handoff.rows_stopped and taken[0] and not taken[-1]
        assert 0 < handoff.chunks_ahead < 2 * 2 * 3 * len(cells)  # not every cell went ahead
        assert handoff.backlog_bytes <= 5_000 + 2 * 10 * 2 * 16 * 2  # the bound + one layer's cell
        for index, layer in enumerate(cache.layers):
            handoff.add_layer(index, layer)
        handoff.finish(first_token=7)
        lane.released.set()
        await until(lambda: lane.frames and lane.frames[-1].type is FrameType.KV_END)
        assert handoff.backlog_bytes == 0
        return [m for frame in lane.frames for m in frame_to_messages(frame)]

    messages = asyncio.run(scenario())
    assert_caches_equal(assemble_messages(messages, fingerprint, builtin_codecs()).cache, cache)
