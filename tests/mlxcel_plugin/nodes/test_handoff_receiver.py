"""HandoffReceiver as a link body sink: raw chunk bodies land in the handoff's own buffers."""

from __future__ import annotations

import pytest

from mlxcel_plugin.builtin_plugin import builtin_codecs
from mlxcel_plugin.kv_codecs import resolve_codec
from mlxcel_plugin.kv_serde import SerializableCacheState
from mlxcel_plugin.link.protocol.frames import BodyParts, FrameType
from mlxcel_plugin.link.read_load import ReadLoad
from mlxcel_plugin.nodes import kv_wire
from mlxcel_plugin.nodes.handoff_receiver import Completed, HandoffReceiver, Refused
from mlxcel_plugin.nodes.kv_wire import message_to_frame
from mlxcel_plugin.testing.caches import (
    assert_caches_equal,
    make_cache,
    make_fingerprint,
    make_header,
)

CODECS = builtin_codecs()
FP = make_fingerprint(num_layers=3, kv_heads=2, head_dim=64, dtype="float16")


class _Link:
    """What feed uses of a link: a key, and its bulk readers' load (none here)."""

    def bulk_read_load(self) -> ReadLoad:
        return ReadLoad()


LINK = _Link()


def frames_for(codec="none", handoff_id="h1", joined=False):
    """The handoff's frames: one chunk per frame, or as a prefill node joins them (two here)."""
    header = make_header(FP, 40, codec=codec, handoff_id=handoff_id)
    cache = make_cache(FP, 40)
    messages = SerializableCacheState(header, cache).to_messages(resolve_codec(codec, CODECS), 2048)
    if joined:
        return [frame for _, frame in kv_wire.frames_for(messages, max_chunk_bytes=4096)], cache
    return [message_to_frame(m) for m in messages], cache


def deliver(receiver, frames):
    """What a link with ``receiver.body_destination`` as its sink hands to recv()."""
    outcome, placed = None, 0
    for frame in frames:
        into = receiver.body_destination(frame.type, frame.header, len(frame.body))
        if into is not None:
            _write(into, bytes(frame.body))
            frame = type(frame)(frame.type, frame.header, into)
            placed += 1
        outcome = receiver.feed(LINK, frame) or outcome
    return outcome, placed


def _write(into, body: bytes) -> None:
    """As the link decrypts a body: into the one buffer, or part by part."""
    at = 0
    for view in into.views if isinstance(into, BodyParts) else (into,):
        view[:] = body[at : at + len(view)]
        at += len(view)


@pytest.mark.parametrize("joined", [False, True], ids=["chunk-per-frame", "joined"])
def test_bodies_are_placed_in_the_handoff_buffers_and_the_cache_is_exact(joined):
    receiver = HandoffReceiver(FP, CODECS, admit=lambda header: None)
    frames, cache = frames_for(joined=joined)
    chunk_frames = [f for f in frames if f.type is FrameType.KV_CHUNK]
    assert any(kv_wire.CHUNKS_KEY in f.header for f in chunk_frames) is joined
    outcome, placed = deliver(receiver, frames)
    assert isinstance(outcome, Completed) and placed == len(frames) - 2
    assert_caches_equal(outcome.state.cache, cache)


def test_a_joined_frame_that_lies_about_its_chunks_refuses_the_handoff():
    receiver = HandoffReceiver(FP, CODECS, admit=lambda header: None)
    frames, _ = frames_for(joined=True)
    joined = next(i for i, f in enumerate(frames) if kv_wire.CHUNKS_KEY in f.header)
    chunks = [dict(c) for c in frames[joined].header[kv_wire.CHUNKS_KEY]]
    chunks[0]["nbytes"] += 1
    header = {**frames[joined].header, kv_wire.CHUNKS_KEY: chunks}
    frames[joined] = type(frames[joined])(FrameType.KV_CHUNK, header, bytes(frames[joined].body))
    outcome, _ = deliver(receiver, frames[: joined + 1])
    assert isinstance(outcome, Refused) and outcome.error.code == "handoff_malformed"
    assert receiver.allocated_bytes == 0 and not receiver.ingests


def test_only_known_handoffs_and_raw_chunks_get_a_destination():
    receiver = HandoffReceiver(FP, CODECS, admit=lambda header: None)
    frames, _ = frames_for()
    chunk = frames[1]
    assert receiver.body_destination(chunk.type, chunk.header, len(chunk.body)) is None
    receiver.feed(LINK, frames[0])
    assert receiver.body_destination(FrameType.KV_END, chunk.header, len(chunk.body)) is None
    assert receiver.body_destination(chunk.type, {**chunk.header, "epoch": 7}, 10) is None
    assert receiver.body_destination(chunk.type, {"handoff_id": ["x"]}, 10) is None
    lz4 = HandoffReceiver(FP, CODECS, admit=lambda header: None)
    lz4_frames, _ = frames_for("lz4")
    lz4.feed(LINK, lz4_frames[0])
    assert lz4.body_destination(lz4_frames[1].type, lz4_frames[1].header, 10) is None


def test_a_damaged_body_placed_in_place_still_fails_the_handoff_and_frees_it():
    receiver = HandoffReceiver(FP, CODECS, admit=lambda header: None)
    frames, _ = frames_for()
    body = bytearray(frames[1].body)
    body[5] ^= 0x10
    frames[1] = type(frames[1])(frames[1].type, frames[1].header, bytes(body))
    outcome, _ = deliver(receiver, frames)
    assert isinstance(outcome, Refused) and outcome.error.code == "handoff_checksum_mismatch"
    assert receiver.allocated_bytes == 0 and not receiver.ingests


def test_an_idle_receiver_keeps_its_pooled_buffers_warm_for_the_next_handoff():
    """No trim while a prefill may be under way: after the idle timer the slabs are still
    held (within the pool's bound), and the next handoff lands in them."""
    import asyncio

    from mlxcel_plugin.kv_serde.pool import BufferPool

    pool = BufferPool(64 << 20)
    receiver = HandoffReceiver(FP, CODECS, admit=lambda header: None, pool=pool,
                               idle_release_s=0.05)

    async def go():
        frames, _ = frames_for()
        outcome, _ = deliver(receiver, frames)
        assert isinstance(outcome, Completed)
        del outcome  # the cache held views of the pool's slabs
        held_after_handoff = pool.held_bytes
        for _ in range(100):  # bounded: the timer fires after 0.05 s
            await asyncio.sleep(0.02)
            if receiver._idle_timer is None:
                break
        assert receiver._idle_timer is None  # the idle look ran
        assert pool.held_bytes == held_after_handoff > 0
        reused = pool.reused
        frames, cache = frames_for(handoff_id="h2")
        outcome, _ = deliver(receiver, frames)
        assert_caches_equal(outcome.state.cache, cache)
        assert pool.reused > reused and pool.held_bytes == held_after_handoff

    asyncio.run(go())
    assert receiver.release_memory() > 0  # an explicit release still empties it
