"""Described layers (MLA, SSM state, quantized K/V) through the KV wire format."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mlxcel_plugin.builtin_plugin import builtin_codecs
from mlxcel_plugin.kv_serde import (
    FingerprintMismatch,
    KVAssembler,
    MalformedHandoff,
    ModelFingerprint,
    SerializableCacheState,
    UnsupportedCacheKind,
    assemble_messages,
)
from mlxcel_plugin.kv_serde.landing import LandedDecode
from mlxcel_plugin.kv_serde.layer_spec import ArraySpec, LayerSpec
from mlxcel_plugin.testing.caches import (
    assert_caches_equal,
    make_described_cache,
    make_fingerprint,
    make_header,
    mixed_fingerprint,
)

FP = mixed_fingerprint()
TOKENS = 20


def _messages(codec: str = "none", chunk_bytes: int = 256, fp: ModelFingerprint = FP):
    cache = make_described_cache(fp, TOKENS)
    state = SerializableCacheState(make_header(fp, TOKENS, codec=codec), cache)
    return cache, state.to_messages(builtin_codecs()[codec], chunk_bytes)


def test_a_fingerprint_round_trips_its_layer_specs():
    parsed = ModelFingerprint.from_dict(FP.to_dict())
    assert parsed == FP and parsed.layers[1].arrays[1].shape == (1, 4, 8, 6)


def test_alike_layers_are_parsed_once_and_a_bad_one_among_them_is_still_refused():
    data = make_fingerprint(num_layers=4, kv_heads=2, head_dim=8).to_dict()
    data["layers"][2] = FP.to_dict()["layers"][1]  # another shape between alike layers
    data["cache_classes"][2] = data["layers"][2]["kind"]
    parsed = ModelFingerprint.from_dict(data)
    assert [layer.to_dict() for layer in parsed.layers] == data["layers"]
    assert parsed.layers[1] is parsed.layers[0] and parsed.layers[3] is not parsed.layers[2]
    data["layers"][3] = {**data["layers"][0], "arrays": [{"name": "k", "shape": [1, 0]}]}
    with pytest.raises(MalformedHandoff, match="'dtype'"):
        ModelFingerprint.from_dict(data)


def test_an_older_fingerprint_means_uniform_kv_layers():
    data = make_fingerprint(num_layers=2, kv_heads=2, head_dim=8).to_dict()
    del data["layers"]
    parsed = ModelFingerprint.from_dict(data)
    assert [layer.names for layer in parsed.layers] == [("k", "v"), ("k", "v")]
    assert parsed.layers[0].arrays[0].shape == (1, 2, 0, 8)


def test_fixed_state_costs_the_same_bytes_for_any_prompt():
    ssm = LayerSpec("ArraysCache", (ArraySpec("s0", (1, 3, 40), "float16"),))
    fp = ModelFingerprint("mamba", 1, 0, 0, "float16", ("ArraysCache",), layers=(ssm,))
    assert fp.kv_bytes(10) == fp.kv_bytes(10_000) == 3 * 40 * 2


@pytest.mark.parametrize("codec", ["none", "lz4"])
def test_mixed_layers_arrive_bit_exact(codec):
    cache, messages = _messages(codec)
    assert_caches_equal(assemble_messages(messages, FP, builtin_codecs()).cache, cache)


def test_a_lossy_codec_leaves_state_and_packed_words_raw():
    cache, messages = _messages("int8")
    got = assemble_messages(messages, FP, builtin_codecs()).cache
    for index, layer in enumerate(cache.layers):
        for spec in FP.layers[index].arrays:
            same = np.array_equal(got.layers[index].array(spec.name), layer.array(spec.name))
            assert same != spec.coded, (index, spec.name)  # coded K/V: approximate only


def test_layers_may_arrive_in_any_order():
    cache, messages = _messages()
    begin, *chunks, end = messages
    assembled = assemble_messages([begin, end, *reversed(chunks)], FP, builtin_codecs())
    assert_caches_equal(assembled.cache, cache)


def test_a_chunk_naming_an_array_its_layer_lacks_is_refused():
    _, messages = _messages()
    begin, chunk = messages[0], messages[1]
    bad = dataclasses.replace(chunk, header={**chunk.header, "tensor": "s9"})
    assembler = KVAssembler(FP, builtin_codecs())
    assembler.feed(begin)
    with pytest.raises(MalformedHandoff, match="s9"):
        assembler.feed(bad)


def test_an_end_with_the_wrong_checksum_count_is_refused():
    _, messages = _messages()
    end = messages[-1]
    sums = [list(c) for c in end.header["checksums"]]
    sums[1] = sums[1][:1]
    bad = dataclasses.replace(end, header={**end.header, "checksums": sums})
    with pytest.raises(MalformedHandoff, match="checksums for layer 1"):
        assemble_messages([*messages[:-1], bad], FP, builtin_codecs())


def test_the_writer_refuses_a_layer_that_does_not_fit_its_spec():
    cache, _ = _messages()
    layer = cache.layers[0]
    layer.values = layer.keys  # an MLA layer's V must be 8 wide, not 24
    state = SerializableCacheState(make_header(FP, TOKENS), cache)
    with pytest.raises(FingerprintMismatch, match="layer 0 v"):
        state.to_messages(builtin_codecs()["none"])


def test_sender_and_receiver_must_describe_the_same_layers():
    other = dataclasses.replace(FP, layers=(FP.layers[3], *FP.layers[1:]), cache_classes=(
        "KVCache", "ArraysCache", "QuantizedKVCache", "KVCache"))
    _, messages = _messages()
    with pytest.raises(FingerprintMismatch, match="layers"):
        assemble_messages(messages, other, builtin_codecs())


def test_a_kind_described_without_arrays_cannot_be_handed_off():
    fp = ModelFingerprint("llama4", 1, 0, 0, "float16", ("MysteryCache",),
                          layers=(LayerSpec("MysteryCache", ()),))
    parsed = ModelFingerprint.from_dict(fp.to_dict())  # a node still starts with it
    with pytest.raises(UnsupportedCacheKind, match="MysteryCache"):
        parsed.check_supported()


def test_raw_arrays_land_in_place_even_under_a_compressing_codec():
    """The link may decrypt SSM state and packed words straight into their buffers; coded
    arrays land in a buffer of their own and are decoded there (as a lane thread does)."""
    cache, messages = _messages("lz4")
    assembler = KVAssembler(FP, builtin_codecs())
    assembler.feed(messages[0])
    result = None
    for message in messages[1:]:
        if message.kind == "chunk":
            spec = FP.layers[message.header["layer"]].array(message.header["tensor"])
            dest = assembler.chunk_destination(message.header)
            assert isinstance(dest, LandedDecode) == spec.coded, spec.name
            view = dest.body if spec.coded else dest
            view[:] = message.body
            if spec.coded:
                dest()  # the decode the bulk thread runs once the body is in
                assert dest.done and dest.error is None
            message = dataclasses.replace(message, body=view)
        result = assembler.feed(message) or result
    assert_caches_equal(result.cache, cache)
