"""Delta handoffs in the serde layer: the header field, the sender's slicing, the receiver."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from mlxcel_plugin.builtin_plugin import builtin_codecs
from mlxcel_plugin.engine_api import CacheState, release_prefix, reserve_prefix
from mlxcel_plugin.kv_codecs import resolve_codec
from mlxcel_plugin.kv_serde import (
    DELTA_SERDE_VERSION,
    SERDE_VERSION,
    HandoffHeader,
    KVAssembler,
    KVMessage,
    KVWriter,
    MalformedHandoff,
    OversizeDeclared,
    SerializableCacheState,
    UnsupportedCacheKind,
    UnsupportedHandoffVersion,
    assemble_messages,
    delta_layer,
)
from mlxcel_plugin.kv_serde.limits import AssemblerLimits
from mlxcel_plugin.link.protocol.frames import MalformedFrame, Request
from mlxcel_plugin.nodes.handoff_policy import delta_prefix_tokens, retries_in_full
from mlxcel_plugin.testing.caches import make_cache, make_fingerprint, make_header
from mlxcel_plugin.transfer import (
    FullTransfer,
    LayerParallelTransfer,
    StrategyOptions,
    StreamedTransfer,
    plan_transfer,
)

CODECS = builtin_codecs()
FP = make_fingerprint(num_layers=3, kv_heads=2, head_dim=64, dtype="float16")
TOKENS, PREFIX = 50, 32
STRATEGIES = {"full": FullTransfer, "streamed": StreamedTransfer,
              "layer-parallel": LayerParallelTransfer}


def delta_header(prefix: int = PREFIX, **changes) -> HandoffHeader:
    return dataclasses.replace(make_header(FP, TOKENS, **changes), prefix_tokens=prefix)


def wire(message: KVMessage) -> KVMessage:
    header = msgpack.unpackb(msgpack.packb(message.header, use_bin_type=True), raw=False)
    return dataclasses.replace(message, header=header, body=bytes(message.body))


def tail(cache: CacheState, prefix: int) -> CacheState:
    return CacheState([dataclasses.replace(layer, keys=layer.keys[:, :, prefix:],
                                           values=layer.values[:, :, prefix:])
                       for layer in cache.layers])


# -- the header field ---------------------------------------------------------------------


def test_a_full_handoff_keeps_its_bytes_and_version():
    header = make_header(FP, TOKENS)
    data = header.to_dict()
    assert "prefix_tokens" not in data and data["version"] == SERDE_VERSION
    assert HandoffHeader.from_message(wire(header.to_message())).prefix_tokens == 0


def test_a_delta_header_round_trips_as_the_delta_version():
    message = wire(delta_header().to_message())
    assert message.header["prefix_tokens"] == PREFIX
    assert message.header["version"] == DELTA_SERDE_VERSION
    parsed = HandoffHeader.from_message(message)
    assert (parsed.prefix_tokens, parsed.shipped_tokens) == (PREFIX, TOKENS - PREFIX)
    assert parsed.sampling.prompt_tokens == tuple(range(TOKENS))


@pytest.mark.parametrize("prefix", [-1, TOKENS, TOKENS + 5, True, "3"])
def test_a_prefix_outside_the_prompt_is_malformed(prefix):
    message = wire(delta_header().to_message())
    with pytest.raises(MalformedHandoff):
        HandoffHeader.from_message(dataclasses.replace(
            message, header={**message.header, "prefix_tokens": prefix}))


def test_a_delta_must_name_its_prompt_and_its_version():
    message = wire(delta_header().to_message())
    no_prompt = {**message.header, "context_tokens": 0}
    with pytest.raises(MalformedHandoff, match="prompt tokens"):
        HandoffHeader.from_message(dataclasses.replace(message, header=no_prompt, body=b""))
    old_version = {**message.header, "version": SERDE_VERSION}
    with pytest.raises(MalformedHandoff, match="serde version"):
        HandoffHeader.from_message(dataclasses.replace(message, header=old_version))


def test_a_receiver_of_the_first_version_refuses_a_delta_by_name(monkeypatch):
    # A node from before delta handoffs knew version 1 only: it refuses at the begin,
    # before allocating, with a code the sender answers by sending the whole cache.
    monkeypatch.setattr("mlxcel_plugin.kv_serde.header.SUPPORTED_SERDE_VERSIONS", (1,))
    assembler = KVAssembler(FP, CODECS)
    with pytest.raises(UnsupportedHandoffVersion) as refused:
        assembler.feed(wire(delta_header().to_message()))
    assert refused.value.code == "handoff_unsupported_version"
    assert assembler.allocated_bytes == 0
    assert retries_in_full(refused.value.code, delta_header())


# -- the sender's slicing -----------------------------------------------------------------


def test_delta_layer_is_a_view_of_the_positions_after_the_prefix():
    layer = make_cache(FP, TOKENS).layers[0]
    sliced = delta_layer(layer, delta_header())
    assert sliced.keys.shape == (1, 2, TOKENS - PREFIX, 64) and sliced.offset == TOKENS
    assert np.shares_memory(sliced.keys, layer.keys)
    assert np.array_equal(sliced.values, layer.values[:, :, PREFIX:])
    assert delta_layer(layer, make_header(FP, TOKENS)) is layer  # a full handoff: untouched


def test_delta_layer_refuses_what_cannot_be_cut():
    rotating = make_fingerprint(1, 2, 64, "float16", ["RotatingKVCache"])
    with pytest.raises(UnsupportedCacheKind):
        delta_layer(make_cache(rotating, TOKENS).layers[0], delta_header())
    short = make_cache(FP, TOKENS - 1).layers[0]
    with pytest.raises(MalformedHandoff, match="whole prompt"):
        delta_layer(short, delta_header())


def test_the_writer_ships_only_the_delta_and_checksums_it():
    cache = make_cache(FP, TOKENS)
    writer = KVWriter(delta_header(), CODECS["none"], chunk_bytes=4096)
    full = KVWriter(make_header(FP, TOKENS), CODECS["none"], chunk_bytes=4096)
    for index, layer in enumerate(cache.layers):
        chunks = writer.layer(index, layer)
        assert {(c.header["tokens"], c.header["offset"]) for c in chunks} == {
            (TOKENS - PREFIX, TOKENS)}
        full.layer(index, layer)
    assert writer.raw_bytes == full.raw_bytes * (TOKENS - PREFIX) // TOKENS


@pytest.mark.parametrize("strategy", ["full", "streamed", "layer-parallel"])
@pytest.mark.parametrize("codec", ["none", "lz4"])
def test_every_strategy_and_codec_carries_a_delta(strategy, codec):
    cache = make_cache(FP, TOKENS, seed=3)
    options = StrategyOptions(resolve_codec(codec, CODECS), chunk_bytes=2048, lanes=2)
    messages = plan_transfer(STRATEGIES[strategy](options), delta_header(), cache)
    received = assemble_messages([wire(m) for m in messages], FP, CODECS)
    assert received.header.prefix_tokens == PREFIX
    for got, want in zip(received.cache.layers, tail(cache, PREFIX).layers, strict=True):
        assert got.offset == TOKENS
        assert np.array_equal(got.keys, want.keys) and np.array_equal(got.values, want.values)


# -- the receiver's checks ----------------------------------------------------------------


def test_the_receiver_budgets_and_allocates_only_the_delta():
    bound = FP.num_layers * 2 * FP.tensor_bytes(TOKENS - PREFIX)
    messages = SerializableCacheState(delta_header(), make_cache(FP, TOKENS)).to_messages(
        CODECS["none"], 4096)
    assembler = KVAssembler(FP, CODECS, AssemblerLimits(max_bytes=bound))
    for message in messages:
        assembler.feed(message)
    assert assembler.done and assembler.allocated_bytes == bound
    with pytest.raises(OversizeDeclared):
        KVAssembler(FP, CODECS, AssemblerLimits(max_bytes=bound - 1)).feed(messages[0])


def test_the_receiver_refuses_a_delta_layer_of_the_wrong_size():
    # A full cache's chunks after a delta begin: the sizes no longer match.
    begin = delta_header().to_message()
    full = SerializableCacheState(make_header(FP, TOKENS), make_cache(FP, TOKENS))
    chunk = full.to_messages(CODECS["none"], 4096)[1]
    assembler = KVAssembler(FP, CODECS)
    assembler.feed(begin)
    with pytest.raises(MalformedHandoff, match="a delta after 32 prefix tokens"):
        assembler.feed(chunk)


def test_the_receiver_refuses_a_delta_for_a_model_it_cannot_cut():
    mixed = make_fingerprint(2, 2, 64, "float16", ["KVCache", "RotatingKVCache"])
    header = dataclasses.replace(make_header(mixed, TOKENS), prefix_tokens=PREFIX)
    with pytest.raises(UnsupportedCacheKind, match="delta"):
        KVAssembler(mixed, CODECS).feed(header.to_message())


# -- the REQUEST field and the prefill node's policy ----------------------------------------


def test_request_carries_decode_cached_tokens_only_when_set():
    plain = Request("r", [1, 2, 3]).to_frame()
    assert "decode_cached_tokens" not in plain.header
    frame = Request("r", list(range(600)), decode_cached_tokens=512).to_frame()
    assert frame.header["decode_cached_tokens"] == 512
    assert Request.from_frame(frame).decode_cached_tokens == 512
    assert Request.from_frame(plain).decode_cached_tokens == 0


@pytest.mark.parametrize("cached", [-1, 3, 4, True])
def test_request_refuses_a_cached_count_outside_the_prompt(cached):
    frame = Request("r", [1, 2, 3]).to_frame()
    frame.header["decode_cached_tokens"] = cached
    with pytest.raises(MalformedFrame):
        Request.from_frame(frame)
    with pytest.raises(MalformedFrame):
        Request("r", [1, 2, 3], decode_cached_tokens=cached).to_frame()


def test_a_delta_only_for_the_routers_target_and_cuttable_models():
    rotating = make_fingerprint(1, 2, 64, "float16", ["RotatingKVCache"])
    assert delta_prefix_tokens(512, True, FP) == 512
    assert delta_prefix_tokens(512, False, FP) == 0  # the count is about the router's node
    assert delta_prefix_tokens(512, True, rotating) == 0
    assert retries_in_full("prefix_missing", delta_header())
    assert retries_in_full("handoff_unsupported_version", delta_header())
    assert not retries_in_full("prefix_missing", make_header(FP, TOKENS))
    assert not retries_in_full("at_capacity", delta_header())


def test_engine_api_prefix_helpers_treat_an_engine_without_them_as_holding_nothing():
    calls = []

    class Reserving:
        def reserve_prefix(self, request_id, tokens, prefix):
            calls.append(("reserve", request_id, tuple(tokens), prefix))
            return True

        def release_prefix(self, request_id):
            calls.append(("release", request_id))

    assert reserve_prefix(object(), "r", [1, 2, 3], 2) is False
    release_prefix(object(), "r")  # nothing to release, nothing raised
    assert reserve_prefix(Reserving(), "r", [1, 2, 3], 2) is True
    release_prefix(Reserving(), "r")
    assert calls == [("reserve", "r", (1, 2, 3), 2), ("release", "r")]
