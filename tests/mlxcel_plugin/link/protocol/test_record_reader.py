"""Link record packing and reading, without sockets."""

import pytest

from mlxcel_plugin.errors import ProtocolError
from mlxcel_plugin.link.protocol.frames import Result, decode_frame, encode_frame
from mlxcel_plugin.link.protocol.record_reader import (
    BULK_LEN,
    KIND_BATCH,
    KIND_BULK,
    KIND_FRAME,
    KIND_LAST,
    KIND_PART,
    BulkBody,
    FrameTooLarge,
    MalformedRecord,
    RecordReader,
    batch_record,
    bulk_record,
    frame_record,
    part_records,
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


def test_a_bulk_record_is_the_kind_byte_the_body_length_then_the_header():
    assert bulk_record(3, b"hdr") == bytes([KIND_BULK]) + BULK_LEN.pack(3) + b"hdr"


@pytest.mark.parametrize("pieces", [1, 2, 3])
def test_parts_split_a_frame_at_the_limit_and_the_reader_rejoins_them(pieces):
    frame = encode_frame(Result("r0", 0, list(range(50))).to_frame())
    limit = -(-len(frame) // pieces)  # the smallest limit that needs ``pieces`` records
    records = list(part_records(frame, limit))
    assert len(records) == pieces and all(len(r) <= limit + 1 for r in records)
    assert [r[0] for r in records] == [KIND_PART] * (pieces - 1) + [KIND_LAST]
    assert b"".join(r[1:] for r in records) == frame
    r = reader()
    got = [item for record in records for item in r.feed(record)]
    assert len(got) == 1 and Result.from_frame(got[0]).token_ids == list(range(50))


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


# -- RecordReader ----------------------------------------------------------------


def reader(max_frame_bytes=1 << 20, bulk=True):
    return RecordReader(max_frame_bytes, bulk=bulk, name="test")


def test_the_reader_gives_frames_of_frame_and_batch_records_in_order():
    frames = encoded_results(3)
    r = reader()
    got = r.feed(frame_record(frames[0])) + r.feed(batch_record(frames[1:]))
    assert [Result.from_frame(f).request_id for f in got] == ["r0", "r1", "r2"]


def test_the_reader_reassembles_parts_within_the_frame_bound():
    (frame,) = encoded_results(1)
    r = reader()
    assert r.feed(bytes([KIND_PART]) + frame[:5]) == []
    (whole,) = r.feed(bytes([KIND_LAST]) + frame[5:])
    assert Result.from_frame(whole).request_id == "r0"
    small = reader(max_frame_bytes=4)
    with pytest.raises(FrameTooLarge):
        small.feed(bytes([KIND_PART]) + frame[:5])


def test_the_reader_announces_bulk_bodies_and_builds_their_frames():
    (frame,) = encoded_results(1)
    r = reader()
    (bulk,) = r.feed(bytes([KIND_BULK]) + BULK_LEN.pack(3) + frame)
    assert isinstance(bulk, BulkBody) and bulk.n_bytes == 3
    assert bytes(r.bulk_frame(bulk, bytearray(b"abc")).body) == b"abc"
    with pytest.raises(FrameTooLarge):
        reader(max_frame_bytes=2).feed(bytes([KIND_BULK]) + BULK_LEN.pack(3) + frame)
    with pytest.raises(ProtocolError, match="without a bulk channel"):
        reader(bulk=False).feed(bytes([KIND_BULK]) + BULK_LEN.pack(3) + frame)


def test_the_reader_skips_unknown_frame_types_and_refuses_bad_records():
    unknown = bytes([200]) + encode_frame(Result("r", 0).to_frame())[1:]
    r = reader()
    assert r.feed(frame_record(unknown)) == []
    (bulk,) = r.feed(bytes([KIND_BULK]) + BULK_LEN.pack(1) + unknown)
    assert r.bulk_frame(bulk, bytearray(b"x")) is None
    with pytest.raises(ProtocolError, match="empty"):
        r.feed(b"")
    with pytest.raises(ProtocolError, match="unknown link record kind 9"):
        r.feed(b"\x09rest")
