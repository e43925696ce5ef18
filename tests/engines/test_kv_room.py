"""A v4 handoff received into the MLX engine's buffers with room (engines/kv_room.py).

The body sink hands the link per-head pieces of each layer's buffer (``kv_wire``), the
engine adopts the layers without a copy, its rebuilt ``KVCache`` holds the received
buffers with room past the prompt, and a decode step writes its token into them in
place: the bytes the decode node holds are the sender's, compared byte for byte.
"""

from __future__ import annotations

import dataclasses
import random

import mlx.core as mx
import msgpack
import numpy as np
import pytest

from engines import kv_convert, kv_room
from mlxcel_plugin.builtin_plugin import builtin_codecs
from mlxcel_plugin.kv_serde import KVAssembler, ReceiveMemory
from mlxcel_plugin.kv_serde.header import (
    CHECKSUM_OF_ENCODED,
    CHECKSUM_OF_HELD,
    CHECKSUM_OF_NONE,
)
from mlxcel_plugin.kv_serde.pool import BufferPool
from mlxcel_plugin.kv_serde.state import SerializableCacheState
from mlxcel_plugin.link.protocol.body_parts import BodyParts
from mlxcel_plugin.link.protocol.checksum import crc32_combine
from mlxcel_plugin.link.protocol.frames import Frame, FrameType
from mlxcel_plugin.nodes.kv_wire import chunk_destinations, frame_to_messages, frames_for
from mlxcel_plugin.testing.caches import make_cache, make_fingerprint, make_header

# 8 heads x 2304 positions x 128 x 2 bytes = 4.5 MiB a tensor: an MLX allocation each.
FP = make_fingerprint(num_layers=2, kv_heads=8, head_dim=128, dtype="float16")
TOKENS = 2100


LANDED: list[int] = []  # where the last receive() wrote each body piece


def land(assembler: KVAssembler, frame: Frame) -> Frame:
    """What the link does with a frame: the body decrypted where the sink says, in order."""
    if frame.type is not FrameType.KV_CHUNK:
        return frame
    body = bytes(frame.body) if isinstance(frame.body, BodyParts) else bytes(frame.body)
    into = chunk_destinations(assembler.chunk_destination, frame.header, len(body),
                              checksums=assembler.header.checksummed)
    if into is None:
        return dataclasses.replace(frame, body=body)
    at = 0
    for view in into.views:
        LANDED.append(np.frombuffer(view, dtype=np.uint8).ctypes.data)
        view[:] = body[at : at + len(view)]
        at += len(view)
    return dataclasses.replace(frame, body=into)


def receive(checksum_of: str, seed: int, codec: str = "none", engine: bool = True,
            pool: BufferPool | None = None, fp=FP):
    """A handoff of ``codec`` fed to an assembler with the MLX engine's buffers and adopter
    (``engine``), else into plain numpy buffers; coded bodies land in ``pool``'s slabs."""
    LANDED.clear()
    cache = make_cache(fp, TOKENS, seed=seed)
    header = dataclasses.replace(make_header(fp, TOKENS, codec=codec), checksum_of=checksum_of)
    messages = SerializableCacheState(header, cache).to_messages(builtin_codecs()[codec],
                                                                 1 << 20)
    begin, *chunks, end = messages
    random.Random(seed).shuffle(chunks)
    memory = ReceiveMemory(pool, kv_convert.ReceiveBuffers() if engine else None)
    assembler = KVAssembler(fp, builtin_codecs(), adopt=kv_convert.adopt_layer if engine else None,
                            memory=memory)
    state = None
    for _, frame in frames_for([begin, *chunks, end]):
        header = msgpack.unpackb(msgpack.packb(frame.header, use_bin_type=True), raw=False)
        for message in frame_to_messages(land(assembler, dataclasses.replace(frame,
                                                                             header=header))):
            state = assembler.feed(message) or state
    assert state is not None
    return cache, state.cache, assembler


def _bits(array: mx.array) -> np.ndarray:
    """An MLX array's bytes as numpy sees them (bfloat16 as its uint16 bits)."""
    return np.array(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_v4_handoff_lands_in_buffers_with_room_and_decode_writes_them_in_place(dtype):
    fp = make_fingerprint(num_layers=2, kv_heads=8, head_dim=128, dtype=dtype)
    sent, received, assembler = receive(CHECKSUM_OF_NONE, seed=3, fp=fp)  # kept: lets go of views
    # A CacheLayer still shows T positions.
    assert [g.keys.shape for g in received.layers] == [w.keys.shape for w in sent.layers]
    caches = kv_convert.from_cache_state(received)
    assert kv_room.held() == 0  # every buffer was taken by its cache
    del received  # as the engine lets go of the handoff: nothing but the caches holds them
    # The first step, before anything reads the caches (a read would evaluate them itself).
    token = mx.ones((1, FP.kv_heads, 1, FP.head_dim), dtype=getattr(mx, dtype))
    for cache in caches:
        cache.update_and_fetch(token, token)
    mx.eval([c.state for c in caches])
    for cache in caches:  # in place: the buffer the handoff landed in (from a cache line on)
        at = np.array(cache.keys.view(mx.uint16), copy=False).ctypes.data
        assert any(0 <= landed - at < 64 for landed in LANDED)
    for cache, want in zip(caches, sent.layers, strict=True):
        assert cache.offset == TOKENS + 1 and cache.keys.shape[2] == 2304  # room: 2100 -> 2304
        assert cache.keys.dtype == getattr(mx, dtype)
        assert np.array_equal(_bits(cache.values[..., :TOKENS, :]), want.values)
        assert np.array_equal(_bits(cache.keys[..., :TOKENS, :]), want.keys)
        assert np.array_equal(_bits(cache.keys[..., TOKENS, :]),
                              _bits(mx.ones((1, 8, 128), dtype=getattr(mx, dtype))))


@pytest.mark.skipif(crc32_combine is None, reason="body crcs are combined with ISA-L's")
def test_an_int8_handoff_lands_in_buffers_with_room_as_its_decoded_bytes():
    """Lossy bodies checksummed as sent (``encoded``) are decoded into per-head pieces of
    buffers with room: the rebuilt caches hold exactly what the same handoff decodes to
    in plain contiguous buffers, and no first-step copy is needed (room past the prompt)."""
    _, plain, _ = receive(CHECKSUM_OF_ENCODED, seed=6, codec="int8", engine=False)
    _, received, _ = receive(CHECKSUM_OF_ENCODED, seed=6, codec="int8")
    caches = kv_convert.from_cache_state(received)
    for cache, want in zip(caches, plain.layers, strict=True):
        assert cache.offset == TOKENS and cache.keys.shape[2] == 2304  # room: 2100 -> 2304
        assert np.array_equal(np.array(cache.keys[..., :TOKENS, :]).view(np.uint16),
                              want.keys.view(np.uint16))
        assert np.array_equal(np.array(cache.values[..., :TOKENS, :]).view(np.uint16),
                              want.values.view(np.uint16))


@pytest.mark.skipif(crc32_combine is None, reason="body crcs are combined with ISA-L's")
def test_coded_bodies_land_in_the_receive_pools_warm_slabs_and_decode_the_same():
    """An int8 chunk's body is decrypted into a pool slab (warm from the last handoff), not
    fresh memory; a second handoff reuses the first one's slabs and still holds exactly the
    bytes its plain decode gives."""
    pool = BufferPool(64 << 20)
    receive(CHECKSUM_OF_ENCODED, seed=7, codec="int8", pool=pool)
    held = pool.held_bytes
    assert held and pool.reused == 0
    _, received, _ = receive(CHECKSUM_OF_ENCODED, seed=8, codec="int8", pool=pool)
    _, plain, _ = receive(CHECKSUM_OF_ENCODED, seed=8, codec="int8", engine=False)
    assert pool.reused > 0 and pool.held_bytes == held
    for got, want in zip(kv_convert.from_cache_state(received), plain.layers, strict=True):
        assert np.array_equal(np.array(got.keys[..., :TOKENS, :]).view(np.uint16),
                              want.keys.view(np.uint16))
        assert np.array_equal(np.array(got.values[..., :TOKENS, :]).view(np.uint16),
                              want.values.view(np.uint16))


@pytest.mark.parametrize("checksum_of", [CHECKSUM_OF_HELD])
def test_a_checksummed_handoff_is_received_without_room_as_before(checksum_of):
    sent, received, _ = receive(checksum_of, seed=4)
    caches = kv_convert.from_cache_state(received)
    for cache, want in zip(caches, sent.layers, strict=True):
        assert cache.keys.shape[2] == TOKENS == cache.offset
        assert np.array_equal(np.array(cache.keys), want.keys)
        assert np.array_equal(np.array(cache.values), want.values)


SMALL = make_fingerprint(num_layers=3, kv_heads=2, head_dim=64, dtype="float16")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["full", "layer-parallel"])
def test_over_real_links_the_decode_cache_holds_the_senders_bytes_with_room(strategy):
    """The main path end to end: a v4 handoff over real links (127.0.0.1, AES-GCM, bulk
    channels; layer-parallel over 3) into a HandoffReceiver with the MLX engine's buffers
    and adopter, as a decode node wires it; the rebuilt caches hold the sender's bytes."""
    import asyncio

    from mlxcel_plugin.builtin_plugin import TRANSFER_STRATEGIES
    from mlxcel_plugin.nodes.handoff_receiver import Completed
    from mlxcel_plugin.transfer import make_strategy
    from tests.mlxcel_plugin.nodes.test_kv_over_lanes import LANES, receive_over_links

    lanes = LANES if strategy == "layer-parallel" else 1
    tokens = 700
    cache = make_cache(SMALL, tokens, seed=5)
    plan = make_strategy(strategy, "none", {s.name: s for s in TRANSFER_STRATEGIES},
                         builtin_codecs(), chunk_bytes=32 * 1024, lanes=lanes)
    header = dataclasses.replace(make_header(SMALL, tokens), checksum_of=CHECKSUM_OF_NONE)
    messages = list(plan.start(header))
    for index, layer in enumerate(cache.layers):
        messages += plan.add_layer(index, layer)
    messages += list(plan.finish())
    outcome, _, seen = asyncio.run(receive_over_links(
        messages, builtin_codecs(), lanes, fingerprint=SMALL, adopt=kv_convert.adopt_layer,
        make_buffers=kv_convert.ReceiveBuffers()))
    assert isinstance(outcome, Completed), outcome
    assert any(isinstance(f.body, BodyParts) and f.body.groups for f in seen)  # per-head pieces
    caches = kv_convert.from_cache_state(outcome.state.cache)
    for rebuilt, want in zip(caches, cache.layers, strict=True):
        assert rebuilt.offset == tokens and rebuilt.keys.shape[2] == 768  # room: 700 -> 768
        assert np.array_equal(np.array(rebuilt.keys[..., :tokens, :]), want.keys)
        assert np.array_equal(np.array(rebuilt.values[..., :tokens, :]), want.values)
