"""``checksum_of = "none"`` (serde v4): raw bodies carry no crc32; AES-GCM authenticates them.

Neither side takes a crc32 of any body, the receiver still holds exactly the
sender's bytes whatever order the chunks come in, and the format is refused
below v4 and for codecs that transform the bytes (those keep their digest).
"""

from __future__ import annotations

import dataclasses
import random

import msgpack
import numpy as np
import pytest

from mlxcel_plugin.builtin_plugin import builtin_codecs
from mlxcel_plugin.kv_serde import HandoffHeader, KVAssembler, MalformedHandoff
from mlxcel_plugin.kv_serde.header import (
    AEAD_ONLY_SERDE_VERSION,
    CHECKSUM_OF_HELD,
    CHECKSUM_OF_NONE,
    SUPPORTED_SERDE_VERSIONS,
)
from mlxcel_plugin.kv_serde.state import SerializableCacheState
from mlxcel_plugin.nodes.kv_wire import chunk_destinations
from mlxcel_plugin.testing.caches import make_cache, make_fingerprint, make_header

FP = make_fingerprint(num_layers=3, kv_heads=2, head_dim=64, dtype="float16")
TOKENS = 300


def header_of(checksum_of: str, codec: str = "none") -> HandoffHeader:
    return dataclasses.replace(make_header(FP, TOKENS, codec=codec), checksum_of=checksum_of)


def on_the_wire(message):
    header = msgpack.unpackb(msgpack.packb(message.header, use_bin_type=True), raw=False)
    return dataclasses.replace(message, header=header, body=bytes(message.body))


class CrcCalls:
    """Stands in for crc32 in the serde modules and counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, data, value=0):
        self.calls += 1
        return 0


@pytest.fixture
def crc_calls(monkeypatch):
    calls = CrcCalls()
    for module in ("writer", "received_layer"):
        monkeypatch.setattr(f"mlxcel_plugin.kv_serde.{module}.crc32", calls)
    return calls


def test_no_crc32_on_either_side_and_the_receiver_holds_the_senders_bytes(crc_calls):
    cache = make_cache(FP, TOKENS, seed=4)
    state = SerializableCacheState(header_of(CHECKSUM_OF_NONE), cache)
    begin, *chunks, end = state.to_messages(builtin_codecs()["none"], 4096)
    assert len(chunks) > FP.num_layers * 2  # tensors split over several chunks
    assert all(crc == 0 for layer in end.header["checksums"] for crc in layer)
    random.Random(7).shuffle(chunks)
    assembler = KVAssembler(FP, builtin_codecs())
    results = [assembler.feed(on_the_wire(m)) for m in [begin, end, *chunks]]
    received = results[-1]
    assert received is not None and received.header.checksum_of == CHECKSUM_OF_NONE
    for got, sent in zip(received.cache.layers, cache.layers, strict=True):
        assert np.array_equal(got.keys, sent.keys) and np.array_equal(got.values, sent.values)
    assert crc_calls.calls == 0
    held = SerializableCacheState(header_of(CHECKSUM_OF_HELD), cache)
    held.to_messages(builtin_codecs()["none"], 4096)
    assert crc_calls.calls > 0  # the first format still checksums (the counter counts)


def test_v4_travels_as_its_version_and_is_refused_below_it_or_with_a_transforming_codec():
    message = header_of(CHECKSUM_OF_NONE).to_message()
    assert message.header["version"] == AEAD_ONLY_SERDE_VERSION == 4
    assert AEAD_ONLY_SERDE_VERSION in SUPPORTED_SERDE_VERSIONS
    assert HandoffHeader.from_message(message).checksum_of == CHECKSUM_OF_NONE
    for changes, error in (({"version": 3}, "needs serde version 4"),
                           ({"codec": "lz4"}, "for codec 'none' only")):
        changed = dataclasses.replace(message, header={**message.header, **changes})
        with pytest.raises(MalformedHandoff, match=error):
            HandoffHeader.from_message(changed)
    with pytest.raises(MalformedHandoff, match="keeps its digest"):
        SerializableCacheState(header_of(CHECKSUM_OF_NONE, "lz4"),
                               make_cache(FP, TOKENS)).to_messages(builtin_codecs()["lz4"])


def test_the_body_sink_asks_the_link_for_no_checksums_on_a_v4_handoff():
    chunk = {"nbytes": 8}
    sink = chunk_destinations(lambda _: memoryview(bytearray(8)), chunk, 8, checksums=False)
    assert sink is not None and not sink.checksums
    assert chunk_destinations(lambda _: memoryview(bytearray(8)), chunk, 8).checksums
