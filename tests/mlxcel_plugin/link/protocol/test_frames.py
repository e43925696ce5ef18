import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxcel_plugin.errors import ProtocolError
from mlxcel_plugin.link.protocol.frames import (
    MAX_PROMPT_TOKENS,
    Cancel,
    ErrorFrame,
    Frame,
    FrameType,
    MalformedFrame,
    Ping,
    PromptTooLong,
    Request,
    Result,
    Telemetry,
    UnknownFrameType,
    decode_frame,
    encode_frame,
    kv_frame,
    pack_token_ids,
    parse_typed,
)
from mlxcel_plugin.link.protocol.handshake import ClientHandshake, ServerHandshake

GOLDEN = bytes.fromhex("07" "0000000f" "81" "aa" + b"request_id".hex() + "a2" + b"r1".hex()) + b"xy"


def test_golden_bytes_encode():
    assert encode_frame(Frame(FrameType.CANCEL, {"request_id": "r1"}, b"xy")) == GOLDEN


def test_golden_bytes_decode_with_zero_copy_body():
    frame = decode_frame(GOLDEN)
    assert frame.type is FrameType.CANCEL and frame.header == {"request_id": "r1"}
    assert isinstance(frame.body, memoryview) and bytes(frame.body) == b"xy"


def test_golden_request_body_is_uint32_little_endian():
    frame = Request("r", [1, 256]).to_frame()
    assert frame.body == b"\x01\x00\x00\x00\x00\x01\x00\x00"


def test_claim_travels_only_when_set():
    assert "claim" not in Request("r", [1]).to_frame().header
    frame = Request("r", [], claim=True).to_frame()
    assert frame.header["claim"] is True and frame.body == b""
    with pytest.raises(MalformedFrame):
        Request.from_frame(Frame(FrameType.REQUEST, {"request_id": "r", "claim": 1}))


def round_trip(obj):
    return parse_typed(decode_frame(encode_frame(obj.to_frame())))


@pytest.mark.parametrize("obj", [
    Request("r1", [1, 2, 3], {"temperature": 0.7, "seed": 5}, 16, [2], "10.0.0.2:9000", 1e9),
    Request("r1", [], {"seed": 5}, 16, [2], claim=True),
    Result("r1", 3, [7, 8], "stop", 12, None),
    Result("r1", 0, [7], None, 1, None, cached_tokens=1024),
    Cancel("r1", "client went away"),
    Telemetry("d1", "decode", 3, 10, 0.5, 123.4),
    Telemetry("p1", "prefill", 0, 1, 0.9, 10.0, 2048, 4096, 1 << 20, 3, 1 << 30),
    Ping(42, 1.5),
    ErrorFrame("at_capacity", "busy", "r1"),
])
def test_typed_round_trip(obj):
    assert round_trip(obj) == obj


def test_missing_optional_fields_take_defaults_and_unknown_are_ignored():
    frame = Frame(FrameType.RESULT, {"request_id": "r", "seq": 0, "from_the_future": [1]})
    assert Result.from_frame(frame) == Result("r", 0)
    req = Request.from_frame(Frame(FrameType.REQUEST, {"request_id": "r"}, pack_token_ids([5])))
    assert req.max_tokens == 256 and req.decode_target is None and req.sampling == {}


def test_prefix_cache_fields_are_absent_when_zero():
    # A node without a hit sends the header older peers know, byte for byte.
    assert "cached_tokens" not in Result("r", 0, [1]).to_frame().header
    assert not any(k.startswith("prefix_") for k in Telemetry("d", "decode").to_frame().header)
    plain = {"request_id": "r", "seq": 0}
    assert Result.from_frame(Frame(FrameType.RESULT, plain)).cached_tokens == 0
    with pytest.raises(MalformedFrame):
        Result.from_frame(Frame(FrameType.RESULT, {**plain, "cached_tokens": "x"}))


def test_missing_required_field_is_malformed():
    with pytest.raises(MalformedFrame):
        Result.from_frame(Frame(FrameType.RESULT, {"seq": 1}))


def test_wrong_field_type_is_malformed():
    with pytest.raises(MalformedFrame):
        Result.from_frame(Frame(FrameType.RESULT, {"request_id": "r", "seq": "one"}))
    with pytest.raises(MalformedFrame):
        Result.from_frame(Frame(FrameType.RESULT, {"request_id": "r", "seq": True}))


def test_kv_frames_carry_header_and_body_untouched():
    frame = kv_frame(FrameType.KV_CHUNK, {"layer": 3, "handoff_id": "h"}, b"\x00\xff" * 8)
    back = parse_typed(decode_frame(encode_frame(frame)))
    assert back.header == {"layer": 3, "handoff_id": "h"} and bytes(back.body) == b"\x00\xff" * 8
    with pytest.raises(ValueError):
        kv_frame(FrameType.REQUEST, {})


def test_prompt_admission_cap():
    over = MAX_PROMPT_TOKENS + 1
    with pytest.raises(PromptTooLong):
        Request("r", [0] * over).to_frame()
    crafted = Frame(FrameType.REQUEST, {"request_id": "r"}, bytes(4 * over))
    with pytest.raises(PromptTooLong):
        Request.from_frame(crafted)
    assert issubclass(PromptTooLong, ProtocolError)


def test_crafted_header_length_cannot_overrun():
    with pytest.raises(MalformedFrame):
        decode_frame(b"\x07\xff\xff\xff\xff\x80")
    # A msgpack array claiming 2**32-1 items inside a 6-byte header.
    bogus = b"\xdd\xff\xff\xff\xff\x00"
    with pytest.raises(MalformedFrame):
        decode_frame(b"\x07\x00\x00\x00\x06" + bogus)


def test_unknown_frame_type_is_its_own_error():
    with pytest.raises(UnknownFrameType):
        decode_frame(b"\xee\x00\x00\x00\x01\x80")


def test_header_must_be_a_map():
    with pytest.raises(MalformedFrame):
        decode_frame(b"\x07\x00\x00\x00\x01" + msgpack.packb(1))


# ---------------------------------------------------------------- fuzzing

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=512))
def test_frame_parser_raises_only_protocol_errors(data):
    try:
        frame = decode_frame(data)
        parse_typed(frame)
    except ProtocolError:
        pass  # the only failure a peer may cause


@FUZZ
@given(st.integers(1, 11), st.dictionaries(st.text(max_size=12), st.one_of(
    st.none(), st.integers(), st.floats(), st.text(max_size=8), st.booleans(),
    st.lists(st.integers(), max_size=4), st.binary(max_size=8)), max_size=6),
    st.binary(max_size=64))
def test_typed_parsers_raise_only_protocol_errors(type_code, header, body):
    try:
        parse_typed(decode_frame(encode_frame(Frame(FrameType(type_code), header, body))))
    except ProtocolError:
        pass


def _fresh_pair():
    return (ClientHandshake(bytes(32), "router", "r"),
            ServerHandshake(bytes(32), "prefill", "p", {"router"}))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=200), min_size=1, max_size=3))
def test_handshake_machines_raise_only_protocol_errors(messages):
    client, server = _fresh_pair()
    client.start()
    for machine in (client, server):
        for message in messages:
            try:
                machine.receive(message)
            except ProtocolError:
                break


@pytest.mark.parametrize("bogus", [
    b"\xdd\xff\xff\xff\xff",  # array32 of 4 G items
    b"\xdf\xff\xff\xff\xff",  # map32 of 4 G pairs
    b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GiB
    b"\xdb\xff\xff\xff\xff",  # str32 of 4 GiB
])
def test_crafted_msgpack_lengths_allocate_nothing_big(bogus):
    import tracemalloc

    data = b"\x07" + len(bogus).to_bytes(4, "big") + bogus
    tracemalloc.start()
    try:
        with pytest.raises(MalformedFrame):
            decode_frame(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024
