"""Rows sent ahead of their layer (each prefill cell's K/V): same cache, same checksums."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mlxcel_plugin.builtin_plugin import builtin_codecs
from mlxcel_plugin.kv_serde import KVWriter, assemble_messages
from mlxcel_plugin.kv_serde.errors import (
    FingerprintMismatch,
    MalformedHandoff,
    UnexpectedMessage,
)
from mlxcel_plugin.kv_serde.header import CHECKSUM_OF_ENCODED
from mlxcel_plugin.testing.caches import (
    assert_caches_equal,
    make_cache,
    make_fingerprint,
    make_header,
)

CODECS = builtin_codecs()
TOKENS = 40
FP = make_fingerprint(num_layers=3, kv_heads=2, head_dim=64, dtype="float16")


def cells_of(layer, bounds):
    """(first token, {"k", "v"} arrays) of each cell ``[a, b)``, as the engine hands them."""
    return [(a, {"k": layer.keys[:, :, a:b].copy(), "v": layer.values[:, :, a:b].copy()})
            for a, b in bounds]


def writer_for(codec="none", checksum_of=None, prefix=0, chunk_bytes=1 << 20):
    header = make_header(FP, TOKENS, codec=codec)
    header = dataclasses.replace(header, prefix_tokens=prefix,
                                 checksum_of=checksum_of or header.checksum_of)
    return KVWriter(header, CODECS[codec], chunk_bytes=chunk_bytes)


def messages_with_cells(writer, cache, bounds):
    messages = [writer.begin()]
    for index, layer in enumerate(cache.layers):
        for first, arrays in cells_of(layer, bounds):
            messages += writer.rows(index, first, arrays)
    early = len(messages) - 1
    for index, layer in enumerate(cache.layers):
        messages += writer.layer(index, layer)
    return [*messages, writer.end()], early


def whole_messages(writer, cache):
    return [writer.begin(), *(m for i, layer in enumerate(cache.layers)
                              for m in writer.layer(i, layer)), writer.end()]


CELLS = [(0, 16), (16, 32), (32, 39)]  # the last token goes alone, with the whole layer


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 512], ids=["chunk-per-run", "small-chunks"])
def test_rows_sent_ahead_assemble_to_the_same_cache_with_the_same_checksums(chunk_bytes):
    cache = make_cache(FP, TOKENS, seed=5)
    messages, early = messages_with_cells(writer_for(chunk_bytes=chunk_bytes), cache, CELLS)
    assert early >= 3 * 2 * 2 * len(CELLS)  # a chunk per head's run, per tensor, per layer
    assert_caches_equal(assemble_messages(messages, FP, CODECS).cache, cache)
    whole = whole_messages(writer_for(chunk_bytes=chunk_bytes), cache)
    assert messages[-1].header["checksums"] == whole[-1].header["checksums"]


def test_chunks_arriving_in_any_order_still_assemble():
    cache = make_cache(FP, TOKENS, seed=6)
    messages, _ = messages_with_cells(writer_for(), cache, CELLS)
    begin, chunks, end = messages[0], messages[1:-1], messages[-1]
    shuffled = [chunks[i] for i in np.random.default_rng(0).permutation(len(chunks))]
    assert_caches_equal(assemble_messages([begin, *shuffled, end], FP, CODECS).cache, cache)


@pytest.mark.parametrize("checksum_of", [None, CHECKSUM_OF_ENCODED], ids=["held", "encoded"])
def test_lossy_rows_sent_ahead_pass_the_receivers_checksums(checksum_of):
    cache = make_cache(FP, TOKENS, seed=7)
    messages, early = messages_with_cells(writer_for("int8", checksum_of), cache, CELLS)
    received = assemble_messages(messages, FP, CODECS).cache
    for got, want in zip(received.layers, cache.layers, strict=True):
        assert np.abs(got.keys.astype("<f4") - want.keys.astype("<f4")).max() < 0.1


def test_a_delta_sends_only_what_follows_the_prefix():
    cache = make_cache(FP, TOKENS, seed=8)
    messages, _ = messages_with_cells(writer_for(prefix=20), cache, CELLS)
    whole = whole_messages(writer_for(prefix=20), cache)
    assert messages[-1].header["checksums"] == whole[-1].header["checksums"]
    rows = sorted((m.header["layer"], m.header["tensor"], m.header["row"], m.header["rows"])
                  for m in messages if m.kind == "chunk" and m.header["layer"] == 0
                  and m.header["tensor"] == "k")
    assert rows == [(0, "k", 0, 12), (0, "k", 12, 7), (0, "k", 19, 1),  # head 0: 20 shipped
                    (0, "k", 20, 12), (0, "k", 32, 7), (0, "k", 39, 1)]


def test_rows_out_of_order_or_after_their_layer_are_refused():
    cache = make_cache(FP, TOKENS, seed=9)
    writer = writer_for()
    writer.begin()
    (_, first), (second_at, second) = cells_of(cache.layers[0], CELLS[:2])
    with pytest.raises(UnexpectedMessage, match="from token 16"):
        writer.rows(0, second_at, second)  # a gap: [0, 16) never came
    writer.rows(0, 0, first)
    writer.layer(0, cache.layers[0])
    with pytest.raises(UnexpectedMessage, match="already sent"):
        writer.rows(0, second_at, second)


@pytest.mark.parametrize("fault", ["no-values", "wrong-dtype", "wrong-heads"])
def test_rows_unlike_the_layers_spec_are_refused(fault):
    cache = make_cache(FP, TOKENS, seed=11)
    (_, arrays), = cells_of(cache.layers[0], CELLS[:1])
    if fault == "no-values":
        del arrays["v"]
    elif fault == "wrong-dtype":
        arrays["v"] = arrays["v"].astype("<f4")
    else:
        arrays["k"] = arrays["k"][:, :1]
    writer = writer_for()
    writer.begin()
    with pytest.raises(FingerprintMismatch, match="layer 0 [kv] rows .* does not match"):
        writer.rows(0, 0, arrays)
    assert writer.chunks == 0


def test_a_layer_unlike_the_rows_sent_ahead_fails_the_handoff():
    cache = make_cache(FP, TOKENS, seed=10)
    writer = writer_for()
    writer.begin()
    writer.rows(0, 0, cells_of(cache.layers[0], CELLS[:1])[0][1])
    odd = dataclasses.replace(cache.layers[0], meta={"changed": True})
    with pytest.raises(MalformedHandoff, match="does not match the rows sent before it"):
        writer.layer(0, odd)


def test_layers_that_are_not_plain_kv_caches_go_whole():
    fp = make_fingerprint(num_layers=2, kinds=["RotatingKVCache", "KVCache"])
    cache = make_cache(fp, TOKENS, seed=11)
    writer = KVWriter(make_header(fp, TOKENS), CODECS["none"])
    writer.begin()
    arrays = {"k": cache.layers[0].keys[:, :, :16], "v": cache.layers[0].values[:, :, :16]}
    assert writer.rows(0, 0, arrays) == []
