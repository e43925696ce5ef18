"""A handoff over real links (127.0.0.1, AES-GCM, bulk channels), received as a decode node does.

For each strategy and codec over several lanes: the receiver's cache holds
the same bytes as the sender's (codec none, lz4) or as the codec's own decode
of what was sent (int8), every chunk body crossed the bulk channel and was
placed by the body sink, and coded chunks were decoded on the bulk channel's
thread, not the event loop. A lane that dies mid-handoff fails the handoff
and frees its buffers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest

from mlxcel_plugin.builtin_plugin import TRANSFER_STRATEGIES, builtin_codecs
from mlxcel_plugin.kv_serde import DEFAULT_MAX_BODY_BYTES, assemble_messages
from mlxcel_plugin.kv_serde.versions import LARGE_CHUNK_BYTES, LARGE_CHUNK_SERDE_VERSION
from mlxcel_plugin.link import LinkConfig, dial_link, serve_links
from mlxcel_plugin.link.bulk import BULK_IN_THREAD
from mlxcel_plugin.link.protocol.frames import FrameType
from mlxcel_plugin.nodes.handoff_receiver import Completed, HandoffReceiver, Refused
from mlxcel_plugin.nodes.kv_wire import frames_for
from mlxcel_plugin.testing.caches import make_cache, make_fingerprint, make_header
from mlxcel_plugin.transfer import make_strategy

SECRET = bytes(range(40, 72))
FP = make_fingerprint(num_layers=6, kv_heads=2, head_dim=64, dtype="float16")
TOKENS = 700
LANES = 3
CONFIG = LinkConfig(ping_interval_s=None, ping_timeout_s=None)
STRATEGIES = {s.name: s for s in TRANSFER_STRATEGIES}
# Generous: on a loaded 2-core machine the int8 cases' BLAS calls (the codec's rotation)
# crawl while other processes hold the cores (one ran past 60 s in a busy full run).
pytestmark = pytest.mark.timeout(180)


class ThreadRecordingCodec:
    """A built-in codec whose decodes note the thread they ran on."""

    def __init__(self, codec):
        self._codec, self.threads = codec, []
        self.decode = self._recorded(codec.decode)
        if hasattr(codec, "decode_into"):
            self.decode_into = self._recorded(codec.decode_into)

    def __getattr__(self, name):
        return getattr(self._codec, name)

    def _recorded(self, decode):
        def recorded(*args):
            self.threads.append(threading.current_thread().name)
            return decode(*args)
        return recorded


def handoff_messages(strategy: str, codec: str, lanes: int):
    cache = make_cache(FP, TOKENS, seed=3)
    plan = make_strategy(strategy, codec, STRATEGIES, builtin_codecs(), chunk_bytes=32 * 1024,
                         lanes=lanes)
    messages = list(plan.start(make_header(FP, TOKENS, codec=codec)))
    for index, layer in enumerate(cache.layers):
        messages += plan.add_layer(index, layer)
    return cache, messages + list(plan.finish())


async def receive_over_links(messages, codecs, lanes: int, cut_lane_after: int | None = None,
                             fingerprint=FP, config=CONFIG, **receiver_args):
    """Send ``messages`` over ``lanes`` links to a HandoffReceiver; its outcome and frames.
    ``receiver_args``: an engine's ``adopt`` and ``make_buffers``, as a decode node passes."""
    receiver = HandoffReceiver(fingerprint, codecs, admit=lambda header: None, **receiver_args)
    outcome: asyncio.Future = asyncio.get_running_loop().create_future()
    seen = []

    def on_frame(link, frame):
        seen.append(frame)
        result = receiver.feed(link, frame)
        if result is not None and not outcome.done():
            outcome.set_result(result)

    async def on_link(link):
        link.set_body_sink(receiver.body_destination)
        link.deliver_to(lambda frame: on_frame(link, frame))
        await link.wait_closed()
        if not outcome.done():  # as the decode node does when a prefill link goes away
            refused = receiver.drop_link(link, ConnectionError("lane closed"))
            outcome.set_result(refused[0] if refused else None)

    server = await serve_links("127.0.0.1:0", SECRET, "decode", "d1", {"prefill"}, on_link,
                               config=config)
    async with server:
        links = [await dial_link(server.address, SECRET, "prefill", "p1", config=config)
                 for _ in range(lanes)]
        for count, (lane, frame) in enumerate(frames_for(messages)):
            if cut_lane_after is not None and count == cut_lane_after:
                await links[1].close()
            if not links[lane % lanes].closed:
                await links[lane % lanes].send(frame)
        result = await asyncio.wait_for(outcome, 30)
        for link in links:
            await link.close()
    return result, receiver, seen


def cache_bytes(cache) -> list[bytes]:
    return [np.ascontiguousarray(a).tobytes() for layer in cache.layers
            for a in layer.arrays().values()]


@pytest.mark.parametrize("codec", ["none", "lz4", "int8"])
@pytest.mark.parametrize("strategy", ["full", "streamed", "layer-parallel"])
def test_the_same_cache_bytes_arrive_over_several_lanes(strategy, codec):
    lanes = LANES if strategy == "layer-parallel" else 1
    cache, messages = handoff_messages(strategy, codec, lanes)
    codecs = builtin_codecs()
    if codec != "none":
        spy = codecs[codec] = ThreadRecordingCodec(codecs[codec])
    outcome, receiver, seen = asyncio.run(receive_over_links(messages, codecs, lanes))
    assert isinstance(outcome, Completed), outcome
    got = cache_bytes(outcome.state.cache)
    if codec == "int8":  # lossy: the bytes the codec's own decode gives, here on one thread
        want = cache_bytes(assemble_messages(messages, FP, builtin_codecs()).cache)
    else:
        want = cache_bytes(cache)
    assert got == want
    chunk_frames = [f for f in seen if f.type is FrameType.KV_CHUNK]
    # Every chunk body came over a bulk channel, decrypted into a buffer the sink chose.
    assert chunk_frames and all(type(f.body).__name__ == "BodyParts" for f in chunk_frames)
    if codec != "none":  # decoded where the bodies landed, never on the event loop
        assert spy.threads and all(t.startswith(BULK_IN_THREAD) for t in spy.threads)
    assert receiver.allocated_bytes == 0 and not receiver.ingests


def test_a_begin_as_big_as_a_bulk_body_is_handled_before_the_first_chunk_is_placed():
    """The begin's body (the prompt's tokens: 2.8 KB here, 32 KB at 8k tokens on a KV link)
    is over the bulk threshold, yet the decode side knows the handoff before the first
    chunk's body arrives, so that chunk lands in its rows like every other."""
    cache, messages = handoff_messages("full", "none", 1)
    begin = next(m for m in messages if m.kind == "begin")
    config = LinkConfig(ping_interval_s=None, ping_timeout_s=None,
                        bulk_threshold_bytes=len(begin.body) // 2)
    outcome, _, seen = asyncio.run(receive_over_links(messages, builtin_codecs(), 1,
                                                      config=config))
    assert isinstance(outcome, Completed), outcome
    assert cache_bytes(outcome.state.cache) == cache_bytes(cache)
    chunk_frames = [f for f in seen if f.type is FrameType.KV_CHUNK]
    assert chunk_frames and all(type(f.body).__name__ == "BodyParts" for f in chunk_frames)


def test_a_tensor_larger_than_a_record_goes_as_one_chunk_and_lands_byte_for_byte():
    """Serde v5: towards a receiver that announced it, a 9 MiB tensor is one chunk (above one
    record's 8 MiB − 64 KiB, which bounded chunks before), over a real bulk channel."""
    fp = make_fingerprint(num_layers=2, kv_heads=4, head_dim=128, dtype="float16")
    tokens = 9 * 1024  # 9 MiB per tensor
    cache = make_cache(fp, tokens, seed=5)
    plan = make_strategy("full", "none", STRATEGIES, builtin_codecs(),
                         chunk_bytes=LARGE_CHUNK_BYTES, max_body_bytes=LARGE_CHUNK_BYTES)
    header = make_header(fp, tokens)
    messages = list(plan.start(dataclasses.replace(header, version=LARGE_CHUNK_SERDE_VERSION)))
    for index, layer in enumerate(cache.layers):
        messages += plan.add_layer(index, layer)
    messages += plan.finish()
    chunks = [m for m in messages if m.kind == "chunk"]
    assert len(chunks) == 2 * fp.num_layers
    assert all(len(m.body) == 9 << 20 > DEFAULT_MAX_BODY_BYTES for m in chunks)
    assert messages[0].header["version"] == LARGE_CHUNK_SERDE_VERSION
    outcome, receiver, _ = asyncio.run(receive_over_links(messages, builtin_codecs(), 1,
                                                          fingerprint=fp))
    assert isinstance(outcome, Completed), outcome
    assert cache_bytes(outcome.state.cache) == cache_bytes(cache)
    assert receiver.allocated_bytes == 0 and not receiver.ingests


def test_a_lane_dying_mid_handoff_fails_it_and_frees_its_buffers():
    _, messages = handoff_messages("layer-parallel", "int8", LANES)
    outcome, receiver, _ = asyncio.run(
        receive_over_links(messages, builtin_codecs(), LANES, cut_lane_after=LANES + 2))
    assert isinstance(outcome, Refused)
    assert receiver.allocated_bytes == 0 and not receiver.ingests
