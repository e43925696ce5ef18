"""KVMessage ⇄ Frame: one message per frame, or consecutive chunks joined into one frame."""

import pytest

from mlxcel_plugin.kv_serde import KVMessage, MalformedHandoff
from mlxcel_plugin.link.protocol.frames import BodyParts, FrameType, Request
from mlxcel_plugin.nodes.kv_wire import (
    FRAME_CHUNK_BYTES,
    FRAME_MAX_CHUNK_BYTES,
    chunk_destinations,
    end_first_token,
    frame_chunk_bytes,
    frame_to_messages,
    frames_for,
    message_to_frame,
)


def chunk(i, body, lane=0, handoff="h"):
    header = {"handoff_id": handoff, "epoch": 1, "layer": i, "nbytes": len(body)}
    return KVMessage("chunk", header, body, lane)


def begin(lane=0):
    return KVMessage("begin", {"handoff_id": "h", "epoch": 1}, b"", lane)


def end():
    return KVMessage("end", {"handoff_id": "h", "epoch": 1})


def on_the_wire(frame):
    """What the receiver sees without a body sink: one contiguous body."""
    return type(frame)(frame.type, frame.header, memoryview(bytes(frame.body)))


def test_kv_messages_map_onto_frames_and_back():
    frame = message_to_frame(end(), first_token=42)
    assert frame.type is FrameType.KV_END and end_first_token(frame) == 42
    assert [m.kind for m in frame_to_messages(frame)] == ["end"]
    single = message_to_frame(KVMessage("chunk", {"a": 1}, b"xy"), first_token=42)
    assert "first_token" not in single.header and bytes(single.body) == b"xy"


def test_a_bad_first_token_or_a_non_kv_frame_is_a_named_refusal():
    with pytest.raises(MalformedHandoff):
        end_first_token(message_to_frame(KVMessage("end", {"first_token": "x"})))
    with pytest.raises(MalformedHandoff):
        frame_to_messages(Request("r", [1]).to_frame())


def test_consecutive_chunks_on_a_lane_share_a_frame_and_split_back_exactly():
    chunks = [chunk(i, bytes([i]) * (i + 1)) for i in range(4)]
    frames = frames_for([begin(), *chunks, end()], first_token=7)
    assert [(lane, f.type) for lane, f in frames] == [
        (0, FrameType.KV_BEGIN), (0, FrameType.KV_CHUNK), (0, FrameType.KV_END)
    ]
    joined = frames[1][1]
    assert isinstance(joined.body, BodyParts) and len(joined.body) == 10
    assert frames[2][1].header["first_token"] == 7
    back = frame_to_messages(on_the_wire(joined))
    assert [(m.header, bytes(m.body)) for m in back] == [(c.header, c.body) for c in chunks]


def test_chunks_are_not_joined_across_lanes_handoffs_or_the_byte_bound():
    messages = [chunk(0, b"aa"), chunk(1, b"bb", lane=1), chunk(2, b"cc", lane=1),
                chunk(3, b"dd", lane=1, handoff="other"), chunk(4, b"eeee"), chunk(5, b"f")]
    frames = frames_for(messages, max_chunk_bytes=4)
    groups = [(lane, [m.header["layer"] for m in frame_to_messages(on_the_wire(f))])
              for lane, f in frames]
    assert groups == [(0, [0]), (1, [1, 2]), (1, [3]), (0, [4]), (0, [5])]
    # A frame of one chunk is that chunk's own frame, as a single-chunk sender sends it.
    assert frames[0][1].header == messages[0].header and bytes(frames[0][1].body) == b"aa"


def test_frames_grow_with_what_is_queued_while_every_lane_keeps_a_body():
    mib = 1024 * 1024
    layer = memoryview(bytearray(4 * mib))  # one K or V of a 2k-token, 8B-shaped layer
    handoff = [chunk(i, layer) for i in range(64)]  # 256 MiB
    assert frame_chunk_bytes(handoff, bulk_lanes=[2]) == FRAME_MAX_CHUNK_BYTES == 64 * mib
    frames = frames_for(handoff, max_chunk_bytes=frame_chunk_bytes(handoff, [2]))
    assert [len(f.body) for _, f in frames] == [64 * mib] * 4
    # 96 MiB over two lanes: two 48 MiB frames, one per lane, not one 64 MiB and one 32 MiB.
    assert frame_chunk_bytes(handoff[:24], [2]) == 48 * mib
    assert frame_chunk_bytes(handoff[:24], [1, 1]) == 48 * mib  # two one-lane links alike
    assert frame_chunk_bytes(handoff[:24], [0, 0]) == 48 * mib  # links without bulk channels
    assert [len(f.body) for _, f in frames_for(handoff[:24], max_chunk_bytes=48 * mib)] == [
        48 * mib, 48 * mib]
    # Little queued (a streamed layer), or many lanes: the least bound, as before.
    assert frame_chunk_bytes(handoff[:2], [2]) == FRAME_CHUNK_BYTES
    assert frame_chunk_bytes(handoff[:8], [4]) == FRAME_CHUNK_BYTES
    assert frame_chunk_bytes([begin(), end()], []) == FRAME_CHUNK_BYTES


def test_a_joined_frame_scattered_by_the_sink_splits_into_the_sinks_buffers():
    chunks = [chunk(0, b"abc"), chunk(1, b"de")]
    (_, frame), = frames_for(chunks)
    layer0 = bytearray(3)
    places = {0: memoryview(layer0)}  # chunk 1 has no place: a fresh buffer of its own
    into = chunk_destinations(lambda h: places.get(h["layer"]), frame.header, 5)
    assert isinstance(into, BodyParts) and [len(v) for v in into.views] == [3, 2]
    into.views[0][:] = b"abc"  # as the link decrypts into the parts
    into.views[1][:] = b"de"
    assert layer0 == b"abc"
    received = type(frame)(frame.type, frame.header, into)
    bodies = [m.body for m in frame_to_messages(received)]
    assert bodies == list(into.views) and bytes(bodies[1]) == b"de"


def test_the_sink_declines_bodies_it_cannot_place_or_that_do_not_add_up():
    (_, frame), = frames_for([chunk(0, b"abc"), chunk(1, b"de")])
    assert chunk_destinations(lambda h: None, frame.header, 5) is None
    assert chunk_destinations(lambda h: memoryview(bytearray(3)), frame.header, 6) is None
    bad = dict(frame.header, chunks=[{"nbytes": -1}, {"nbytes": 6}])
    assert chunk_destinations(lambda h: memoryview(bytearray(3)), bad, 5) is None


@pytest.mark.parametrize("chunks", ["x", [], [{"nbytes": 2}, {"nbytes": 2}], [{"nbytes": "5"}]])
def test_a_joined_frame_whose_chunks_do_not_describe_its_body_is_refused(chunks):
    (_, frame), = frames_for([chunk(0, b"abc"), chunk(1, b"de")])
    bad = type(frame)(frame.type, dict(frame.header, chunks=chunks), memoryview(b"abcde"))
    with pytest.raises(MalformedHandoff):
        frame_to_messages(bad)


def test_the_crcs_the_link_took_as_chunks_landed_travel_with_each_chunk():
    (_, frame), = frames_for([chunk(0, b"abc"), chunk(1, b"de")])
    into = chunk_destinations(lambda h: memoryview(bytearray(h["nbytes"])), frame.header, 5)
    assert into.checksums and into.crcs is None  # asked of the link, not yet taken
    received = type(frame)(frame.type, frame.header, into)
    assert [m.body_crc for m in frame_to_messages(received)] == [None, None]
    into.crcs = [11, 22]  # as the bulk channel sets them once every part is in
    assert [m.body_crc for m in frame_to_messages(received)] == [11, 22]
    single = message_to_frame(chunk(0, b"abc"))
    one = chunk_destinations(lambda h: memoryview(bytearray(3)), single.header, 3)
    one.crcs = [33]
    (message,) = frame_to_messages(type(single)(single.type, single.header, one))
    assert message.body_crc == 33 and len(message.body) == 3
