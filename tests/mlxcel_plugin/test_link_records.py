"""Link record packing, without sockets."""

import pytest

from mlxcel_plugin.frames import Result, decode_frame, encode_frame
from mlxcel_plugin.link_records import (
    KIND_BATCH,
    KIND_FRAME,
    MalformedRecord,
    batch_record,
    frame_record,
    split_batch,
)


def encoded_results(n):
    return [encode_frame(Result(f"r{i}", i, [i, i + 1]).to_frame()) for i in range(n)]


def test_a_batch_round_trips_its_frames_in_order():
    frames = encoded_results(5)
    record = batch_record(frames)
    assert record[0] == KIND_BATCH
    split = split_batch(memoryview(record)[1:])
    assert [bytes(view) for view in split] == frames
    assert [Result.from_frame(decode_frame(view)).request_id for view in split] == [
        "r0", "r1", "r2", "r3", "r4"]


def test_a_frame_record_is_the_kind_byte_then_the_frame():
    (frame,) = encoded_results(1)
    assert frame_record(frame) == bytes([KIND_FRAME]) + frame


@pytest.mark.parametrize("body, why", [
    (b"", "empty"),
    (b"\x00\x00", "ends inside a frame length"),
    (b"\x00\x00\x00\x00", "0 bytes"),
    (b"\x00\x00\x00\x09abc", "9 bytes"),
    (b"\x00\x00\x00\x01a\x00\x00\x00", "ends inside a frame length"),
])
def test_a_malformed_batch_is_refused_by_name(body, why):
    with pytest.raises(MalformedRecord, match=why) as info:
        split_batch(memoryview(body))
    assert info.value.code == "record_malformed"
