"""KV serde: headers, the assembler's refusals (one test each), and fuzzing."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxcel_plugin.builtin_plugin import builtin_codecs
from mlxcel_plugin.engine_api import CacheLayer, GenerationRequest, SamplingParams
from mlxcel_plugin.errors import HandoffError, ProtocolError
from mlxcel_plugin.kv_codecs import resolve_codec
from mlxcel_plugin.kv_serde import (
    AckHeader,
    AssemblerLimits,
    BufferPool,
    ChecksumMismatch,
    FingerprintMismatch,
    HandoffHeader,
    KVAssembler,
    KVMessage,
    KVWriter,
    LayerCountMismatch,
    MalformedHandoff,
    ModelFingerprint,
    OversizeDeclared,
    ReceiveMemory,
    RequestMismatch,
    SerializableCacheState,
    SerializableSamplingState,
    StaleEpoch,
    TruncatedLayer,
    UnexpectedMessage,
    UnknownCodec,
    UnsupportedCacheKind,
    UnsupportedHandoffVersion,
    assemble_messages,
    make_ack,
)
from mlxcel_plugin.kv_serde.landing import LandedDecode
from mlxcel_plugin.testing.caches import (
    assert_caches_equal,
    make_cache,
    make_fingerprint,
    make_header,
)

CODECS = builtin_codecs()
FP = make_fingerprint(num_layers=3, kv_heads=2, head_dim=64, dtype="float16")
TOKENS = 50


def messages_for(fp=FP, tokens=TOKENS, codec="none", chunk_bytes=4096, **header_fields):
    header = make_header(fp, tokens, codec=codec, **header_fields)
    cache = make_cache(fp, tokens)
    state = SerializableCacheState(header, cache)
    return state.to_messages(resolve_codec(codec, CODECS), chunk_bytes), cache


def feed_all(messages, assembler=None, fp=FP):
    assembler = assembler or KVAssembler(fp, CODECS)
    result = None
    for message in messages:
        result = assembler.feed(message) or result
    return result


def with_header(message: KVMessage, **changes) -> KVMessage:
    return dataclasses.replace(message, header={**message.header, **changes})


def wire(message: KVMessage) -> KVMessage:
    """The message as the peer decodes it: header through msgpack, body as bytes."""
    header = msgpack.unpackb(msgpack.packb(message.header, use_bin_type=True), raw=False)
    return dataclasses.replace(message, header=header, body=bytes(message.body))


# -- headers ---------------------------------------------------------------


def test_begin_header_survives_msgpack():
    header = make_header(FP, TOKENS, codec="lz4")
    message = wire(header.to_message())
    assert "prompt_tokens" not in message.header["sampling"]
    assert message.body == np.arange(TOKENS, dtype="<u4").tobytes()
    assert HandoffHeader.from_message(message) == header


def test_header_rebuilds_the_generation_request():
    request = GenerationRequest(
        request_id="r9",
        prompt_tokens=(5, 6, 7),
        max_tokens=9,
        sampling=SamplingParams(temperature=0.5, top_k=40, seed=3, frequency_penalty=0.2),
        stop_token_ids=(11,),
    )
    header = HandoffHeader(
        request_id="r9",
        handoff_id="h",
        epoch=2,
        fingerprint=FP,
        prompt_length=3,
        first_token=8,
        sampling=SerializableSamplingState.from_request(request, step=1),
    )
    parsed = HandoffHeader.from_message(header.to_message())
    assert parsed.to_request() == request
    assert parsed.sampling.seed == 3 and parsed.sampling.step == 1


def test_fingerprint_from_engine_model_info_ignores_unknown_keys():
    info = {**FP.to_dict(), "vocab_size": 49152}
    assert ModelFingerprint.from_dict(info) == FP


def test_fingerprint_compares_weight_digests_when_both_have_one():
    ours = dataclasses.replace(FP, model_digest="abc")
    dataclasses.replace(FP, model_digest="").check_matches(ours)
    with pytest.raises(FingerprintMismatch):
        dataclasses.replace(FP, model_digest="xyz").check_matches(ours)


@pytest.mark.parametrize(
    "params", [{"temperature": "hot"}, {"top_k": 1.5}, {"seed": True}, {"top_p": float("nan")}]
)
def test_sampling_params_are_type_checked(params):
    message = make_header(FP, TOKENS).to_message()
    message.header["sampling"]["params"].update(params)
    with pytest.raises(MalformedHandoff):
        HandoffHeader.from_message(message)


@pytest.mark.parametrize(("context_tokens", "body"), [(TOKENS, b"\0" * 8), (2, b"\0" * 8)])
def test_context_tokens_must_match_prompt_length_and_body(context_tokens, body):
    message = make_header(FP, TOKENS).to_message()
    message.header["context_tokens"] = context_tokens
    with pytest.raises(MalformedHandoff):
        HandoffHeader.from_dict(message.header, body)


def test_a_handoff_may_omit_the_penalty_context():
    header = dataclasses.replace(
        make_header(FP, TOKENS),
        sampling=SerializableSamplingState(max_tokens=5),
    )
    message = header.to_message()
    assert message.header["context_tokens"] == 0 and message.body == b""
    assert HandoffHeader.from_message(message) == header


def test_ack_round_trip():
    ok = make_ack("r", "h", 1)
    assert AckHeader.from_dict(wire(ok).header) == AckHeader("r", "h", 1, ok=True)
    refused = AckHeader.from_dict(make_ack("r", "h", 1, StaleEpoch("old")).header)
    assert not refused.ok and refused.error_code == "handoff_stale_epoch"
    assert refused.error == "old"


def test_an_ack_says_how_busy_the_readers_were_and_bounds_it():
    paced = AckHeader.from_dict(wire(make_ack("r", "h", 1, reader_busy_share=0.93)).header)
    assert paced.ok and paced.reader_busy_share == pytest.approx(0.93)
    older_peer = make_ack("r", "h", 1).header
    del older_peer["reader_busy_share"]  # a decode node from before it: unmeasured
    assert AckHeader.from_dict(older_peer).reader_busy_share is None
    with pytest.raises(MalformedHandoff, match="reader_busy_share"):
        AckHeader.from_dict({**make_ack("r", "h", 1).header, "reader_busy_share": 7})


# -- happy paths -----------------------------------------------------------


def test_round_trip_through_msgpack_headers():
    messages, cache = messages_for(codec="lz4")
    result = feed_all([wire(m) for m in messages])
    assert_caches_equal(result.cache, cache)
    assert result.header == make_header(FP, TOKENS, codec="lz4")


def test_rotating_cache_keeps_its_window_offset_and_meta():
    fp = make_fingerprint(2, 2, 64, "bfloat16", ["RotatingKVCache", "KVCache"])
    cache = make_cache(fp, 300, rotating_max_size=128)
    assert cache.layers[0].keys.shape[2] == 128 and cache.layers[0].offset == 300
    messages = SerializableCacheState(make_header(fp, 300), cache).to_messages(CODECS["none"])
    result = assemble_messages([wire(m) for m in messages], fp, CODECS)
    assert_caches_equal(result.cache, cache)
    assert result.cache.layers[0].meta["max_size"] == 128


def test_sender_bodies_are_views_of_the_cache():
    header = make_header(FP, TOKENS)
    cache = make_cache(FP, TOKENS)
    writer = KVWriter(header, CODECS["none"], chunk_bytes=1 << 20)
    (k_chunk, v_chunk) = writer.layer(0, cache.layers[0])
    assert np.shares_memory(np.frombuffer(k_chunk.body, np.uint8), cache.layers[0].keys)
    assert np.shares_memory(np.frombuffer(v_chunk.body, np.uint8), cache.layers[0].values)


def test_end_may_overtake_chunks_from_other_lanes():
    messages, cache = messages_for()
    begin, chunks, end = messages[0], messages[1:-1], messages[-1]
    assembler = KVAssembler(FP, CODECS)
    assert feed_all([begin, end, *chunks[:-1]], assembler) is None
    assert_caches_equal(assembler.feed(chunks[-1]).cache, cache)


def test_an_identical_duplicate_begin_is_accepted_even_after_completion():
    messages, cache = messages_for()
    result = feed_all([messages[0], *messages, messages[0]])
    assert_caches_equal(result.cache, cache)


def test_a_begin_parsed_by_the_receiver_starts_the_handoff_as_its_message_would():
    messages, cache = messages_for()
    assembler = KVAssembler(FP, CODECS)
    assembler.begin(HandoffHeader.from_message(messages[0]))
    assert_caches_equal(feed_all(messages[1:], assembler).cache, cache)
    with pytest.raises(UnexpectedMessage, match="already done"):
        assembler.begin(HandoffHeader.from_message(messages[0]))
    mismatched, _ = messages_for(fp=make_fingerprint(3, 2, 128, "float16"))
    refusing = KVAssembler(FP, CODECS)
    with pytest.raises(FingerprintMismatch):
        refusing.begin(HandoffHeader.from_message(mismatched[0]))
    with pytest.raises(UnexpectedMessage, match="already failed"):
        refusing.feed(messages[1])


def test_allocation_is_per_layer_and_bounded_by_what_arrived():
    messages, _ = messages_for()
    assembler = KVAssembler(FP, CODECS)
    assembler.feed(messages[0])
    assert assembler.allocated_bytes == 0
    assembler.feed(messages[1])
    assert assembler.allocated_bytes == 2 * FP.tensor_bytes(TOKENS)


# -- refusals: one test each -----------------------------------------------


def test_refuses_a_fingerprint_mismatch_before_allocating():
    messages, _ = messages_for(fp=make_fingerprint(3, 2, 128, "float16"))
    assembler = KVAssembler(FP, CODECS)
    with pytest.raises(FingerprintMismatch, match="head_dim"):
        assembler.feed(messages[0])
    assert assembler.allocated_bytes == 0


def test_refuses_another_dtype():
    messages, _ = messages_for(fp=make_fingerprint(3, 2, 64, "bfloat16"))
    with pytest.raises(FingerprintMismatch, match="dtype"):
        KVAssembler(FP, CODECS).feed(messages[0])


def test_refuses_a_wrong_layer_count():
    messages, _ = messages_for(fp=make_fingerprint(4, 2, 64, "float16"))
    with pytest.raises(LayerCountMismatch):
        KVAssembler(FP, CODECS).feed(messages[0])


def test_refuses_a_chunk_for_a_layer_beyond_the_model():
    messages, _ = messages_for()
    assembler = KVAssembler(FP, CODECS)
    assembler.feed(messages[0])
    with pytest.raises(LayerCountMismatch):
        assembler.feed(with_header(messages[1], layer=3))


def test_refuses_a_short_chunk_body():
    messages, _ = messages_for()
    assembler = KVAssembler(FP, CODECS)
    assembler.feed(messages[0])
    short = dataclasses.replace(messages[1], body=bytes(messages[1].body)[:-10])
    with pytest.raises(TruncatedLayer):
        assembler.feed(short)


def test_refuses_a_layer_left_incomplete_by_the_declared_count():
    messages, _ = messages_for()
    begin, chunks, end = messages[0], messages[1:-1], messages[-1]
    lying_end = with_header(end, chunks=len(chunks) - 1)
    with pytest.raises(TruncatedLayer, match="layer 0"):
        feed_all([begin, *chunks[1:], lying_end])


def test_expire_names_the_missing_layers_and_frees_buffers():
    messages, _ = messages_for()
    assembler = KVAssembler(FP, CODECS)
    feed_all(messages[:3], assembler)
    with pytest.raises(TruncatedLayer, match=r"incomplete layers \[0, 1, 2\]"):
        assembler.expire()
    assert assembler.allocated_bytes == 0


def test_refuses_a_checksum_mismatch():
    messages, _ = messages_for()
    body = bytearray(messages[2].body)
    body[7] ^= 0x01
    corrupted = dataclasses.replace(messages[2], body=bytes(body))
    with pytest.raises(ChecksumMismatch, match="layer 0"):
        feed_all([*messages[:2], corrupted, *messages[3:]])


def feed_in_place(messages, assembler):
    """Like the link with a body sink: each raw chunk body is written where the assembler says."""
    result, placed = None, 0
    for message in messages:
        if message.kind == "chunk":
            into = assembler.chunk_destination(message.header)
            if into is not None:
                into[:] = message.body
                message = dataclasses.replace(message, body=into)
                placed += 1
        result = assembler.feed(message) or result
    return result, placed


def test_raw_chunks_can_be_written_in_place():
    messages, cache = messages_for()
    pool = BufferPool()
    result, placed = feed_in_place(messages, KVAssembler(FP, CODECS, memory=ReceiveMemory(pool)))
    assert placed == len(messages) - 2
    assert_caches_equal(result.cache, cache)
    # The layer buffers are the pool's: every array's memory belongs to one of its slabs.
    assert all(layer.keys.base is not None for layer in result.cache.layers)


def test_a_body_written_in_place_is_still_checksummed():
    messages, _ = messages_for()
    assembler = KVAssembler(FP, CODECS)
    assembler.feed(messages[0])
    into = assembler.chunk_destination(messages[1].header)
    into[:] = messages[1].body
    into[3] ^= 0x01
    assembler.feed(dataclasses.replace(messages[1], body=into))
    with pytest.raises(ChecksumMismatch, match="layer 0"):
        feed_all(messages[2:], assembler)


def test_no_destination_for_refused_headers_or_claimed_rows_coded_chunks_decode_elsewhere():
    lz4, _ = messages_for(codec="lz4")
    assembler = KVAssembler(FP, CODECS)
    assembler.feed(lz4[0])
    landing = assembler.chunk_destination(lz4[1].header)
    assert isinstance(landing, LandedDecode)  # not the rows: a buffer decoded where it lands
    assert len(landing.body) == lz4[1].header["nbytes"]
    messages, cache = messages_for()
    assembler = KVAssembler(FP, CODECS)
    assert assembler.chunk_destination(messages[1].header) is None  # before begin
    assembler.feed(messages[0])
    assert assembler.chunk_destination({**messages[1].header, "epoch": 9}) is None
    assert assembler.chunk_destination(messages[1].header) is not None
    assert assembler.chunk_destination(messages[1].header) is None  # rows already reserved
    # The reserved chunk may still arrive with its body elsewhere (copied in).
    assert_caches_equal(feed_all(messages[1:], assembler).cache, cache)


def test_a_duplicate_of_a_chunk_placed_in_place_is_refused():
    messages, _ = messages_for()
    assembler = KVAssembler(FP, CODECS)
    feed_in_place(messages[:2], assembler)
    with pytest.raises(UnexpectedMessage, match="overlap"):
        assembler.feed(messages[1])


def test_a_placed_chunk_counts_once_fed_with_the_header_it_was_placed_with():
    """``chunk_destination`` claims the rows for that header object (feed takes its checked
    header without parsing it again): a copy of the header meets claimed rows, and a body
    of the wrong length is still refused."""
    messages, _ = messages_for()
    assembler = KVAssembler(FP, CODECS)
    assembler.feed(messages[0])
    assert assembler.chunk_destination(messages[1].header) is not None
    with pytest.raises(UnexpectedMessage, match="overlap"):
        assembler.feed(dataclasses.replace(messages[1], header=dict(messages[1].header)))
    assembler = KVAssembler(FP, CODECS)
    assembler.feed(messages[0])
    assert assembler.chunk_destination(messages[1].header) is not None
    with pytest.raises(TruncatedLayer, match="chunk body"):
        assembler.feed(dataclasses.replace(messages[1], body=messages[1].body[:-1]))


def test_a_tensor_is_checksummed_as_soon_as_end_and_its_rows_are_there():
    messages, _ = messages_for()
    chunks = [m for m in messages if m.kind == "chunk"]
    first = chunks[0]
    body = bytearray(first.body)
    body[0] ^= 0x01
    assembler = KVAssembler(FP, CODECS)
    assembler.feed(messages[0])
    assembler.feed(messages[-1])  # end first, as on another lane
    layer0_k = [c for c in chunks if c.header["layer"] == 0 and c.header["tensor"] == "k"]
    for chunk in layer0_k[1:]:
        assembler.feed(chunk)
    with pytest.raises(ChecksumMismatch, match="layer 0 k"):
        assembler.feed(dataclasses.replace(first, body=bytes(body)))


def test_checksum_also_guards_lossy_codecs():
    messages, _ = messages_for(codec="int8")
    end = messages[-1]
    checksums = [list(pair) for pair in end.header["checksums"]]
    checksums[1][1] ^= 1
    with pytest.raises(ChecksumMismatch, match="layer 1 v"):
        feed_all([*messages[:-1], with_header(end, checksums=checksums)])


def test_refuses_an_unknown_codec():
    messages, _ = messages_for()
    assembler = KVAssembler(FP, CODECS)
    with pytest.raises(UnknownCodec, match="zstd"):
        assembler.feed(with_header(messages[0], codec="zstd"))
    assert assembler.allocated_bytes == 0


def test_refuses_a_stale_epoch_at_begin():
    messages, _ = messages_for(epoch=1)
    with pytest.raises(StaleEpoch):
        KVAssembler(FP, CODECS, min_epoch=2).feed(messages[0])


def test_refuses_a_chunk_from_another_attempt():
    messages, _ = messages_for(epoch=1)
    old, _ = messages_for(epoch=0)
    assembler = KVAssembler(FP, CODECS)
    assembler.feed(messages[0])
    with pytest.raises(StaleEpoch):
        assembler.feed(old[1])


def test_refuses_an_oversize_cache_before_allocating():
    messages, _ = messages_for()
    assembler = KVAssembler(FP, CODECS, AssemblerLimits(max_bytes=50_000))
    with pytest.raises(OversizeDeclared, match="budget"):
        assembler.feed(messages[0])
    assert assembler.allocated_bytes == 0


def test_refuses_an_oversize_declared_chunk_body():
    messages, _ = messages_for()
    assembler = KVAssembler(FP, CODECS, AssemblerLimits(max_body_bytes=1024))
    assembler.feed(messages[0])
    with pytest.raises(OversizeDeclared):
        assembler.feed(messages[1])


def test_refuses_an_oversize_prompt():
    messages, _ = messages_for()
    with pytest.raises(OversizeDeclared, match="prompt_length"):
        KVAssembler(FP, CODECS, AssemblerLimits(max_prompt_tokens=10)).feed(messages[0])


def test_refuses_unsupported_cache_kinds():
    fp = make_fingerprint(2, 2, 64, "float16", ["KVCache", "MysteryCache"])
    header = make_header(fp, 4)
    with pytest.raises(UnsupportedCacheKind):
        KVWriter(header, CODECS["none"])
    with pytest.raises(UnsupportedCacheKind):
        KVAssembler(fp, CODECS).feed(header.to_message())


def test_refuses_another_request():
    messages, _ = messages_for()
    with pytest.raises(RequestMismatch):
        KVAssembler(FP, CODECS, expected_request_id="other").feed(messages[0])


def test_refuses_an_unknown_serde_version():
    messages, _ = messages_for()
    with pytest.raises(UnsupportedHandoffVersion):
        KVAssembler(FP, CODECS).feed(with_header(messages[0], version=99))


def test_refuses_a_chunk_before_begin():
    messages, _ = messages_for()
    with pytest.raises(UnexpectedMessage):
        KVAssembler(FP, CODECS).feed(messages[1])


def test_refuses_a_duplicate_chunk():
    messages, _ = messages_for()
    with pytest.raises(UnexpectedMessage, match="overlap"):
        feed_all([messages[0], messages[1], messages[1]])


def test_refuses_a_different_second_begin():
    messages, _ = messages_for()
    with pytest.raises(UnexpectedMessage):
        feed_all([messages[0], with_header(messages[0], first_token=7)])


def test_a_failed_handoff_frees_memory_and_stays_failed():
    messages, _ = messages_for()
    assembler = KVAssembler(FP, CODECS)
    assembler.feed(messages[0])
    assembler.feed(messages[1])
    with pytest.raises(UnexpectedMessage):
        assembler.feed(messages[1])
    assert assembler.allocated_bytes == 0
    with pytest.raises(UnexpectedMessage, match="already failed"):
        assembler.feed(messages[2])


# -- sender-side refusals --------------------------------------------------


def test_writer_refuses_to_end_without_every_layer():
    cache = make_cache(FP, TOKENS)
    writer = KVWriter(make_header(FP, TOKENS), CODECS["none"])
    writer.layer(0, cache.layers[0])
    with pytest.raises(TruncatedLayer):
        writer.end()


def test_writer_refuses_a_layer_whose_kind_differs_from_the_fingerprint():
    cache = make_cache(FP, TOKENS)
    layer = dataclasses.replace(cache.layers[0], kind="RotatingKVCache")
    with pytest.raises(UnsupportedCacheKind):
        KVWriter(make_header(FP, TOKENS), CODECS["none"]).layer(0, layer)


def test_writer_refuses_a_layer_holding_more_than_the_prompt():
    layer = make_cache(FP, TOKENS + 1).layers[0]
    with pytest.raises(MalformedHandoff):
        KVWriter(make_header(FP, TOKENS), CODECS["none"]).layer(0, layer)


def test_writer_refuses_a_bf16_layer_not_in_uint16_view():
    fp = make_fingerprint(1, 1, 64, "bfloat16")
    keys = np.zeros((1, 1, 4, 64), dtype=np.float32)
    layer = CacheLayer("KVCache", keys, keys, "bfloat16", 4)
    with pytest.raises(FingerprintMismatch):
        KVWriter(make_header(fp, 4), CODECS["none"]).layer(0, layer)


# -- fuzzing: only HandoffError/ProtocolError, bounded allocation -----------

FUZZ_FP = make_fingerprint(num_layers=2, kv_heads=1, head_dim=8, dtype="float16")
FUZZ_LIMITS = AssemblerLimits(max_bytes=64 * 1024, max_prompt_tokens=4096)
FUZZ_BASE, _ = messages_for(fp=FUZZ_FP, tokens=6, chunk_bytes=32)
FUZZ_BASE_LZ4, _ = messages_for(fp=FUZZ_FP, tokens=6, chunk_bytes=32, codec="int8+lz4")

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(-2, 5000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=16,
)
HEADER_KEYS = sorted(
    {key for message in FUZZ_BASE + FUZZ_BASE_LZ4 for key in message.header} | {"x"}
)
headers = st.dictionaries(st.sampled_from(HEADER_KEYS) | st.text(max_size=6), values, max_size=14)
kinds = st.sampled_from(["begin", "chunk", "end", "ack", "bogus"])
any_message = st.builds(KVMessage, kind=kinds, header=headers, body=st.binary(max_size=96))


def feed_expecting_refusals(messages: list[KVMessage]) -> None:
    assembler = KVAssembler(FUZZ_FP, CODECS, FUZZ_LIMITS)
    for message in messages:
        try:
            assembler.feed(message)
        except (HandoffError, ProtocolError):
            pass  # refusals are the point; any other exception fails the test
        assert assembler.allocated_bytes <= FUZZ_LIMITS.max_bytes


@settings(max_examples=300, deadline=None)
@given(st.lists(any_message, max_size=8))
def test_arbitrary_messages_only_raise_handoff_errors(messages):
    feed_expecting_refusals(messages)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_handoffs_only_raise_handoff_errors(data):
    messages = list(data.draw(st.sampled_from([FUZZ_BASE, FUZZ_BASE_LZ4])))
    for _ in range(data.draw(st.integers(1, 4))):
        index = data.draw(st.integers(0, len(messages) - 1))
        operation = data.draw(st.sampled_from(["field", "body", "drop", "dup", "swap"]))
        message = messages[index]
        if operation == "field":
            key = data.draw(st.sampled_from(sorted(message.header)))
            messages[index] = with_header(message, **{key: data.draw(values)})
        elif operation == "body":
            messages[index] = dataclasses.replace(message, body=data.draw(st.binary(max_size=96)))
        elif operation == "drop":
            del messages[index]
        elif operation == "dup":
            messages.insert(index, message)
        else:
            other = data.draw(st.integers(0, len(messages) - 1))
            messages[index], messages[other] = messages[other], messages[index]
        if not messages:
            break
    feed_expecting_refusals(messages)
