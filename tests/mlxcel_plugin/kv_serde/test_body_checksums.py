"""``checksum_of = "encoded"``: a lossy handoff's end checksums cover the chunk bodies as sent.

The sender no longer decodes its own output, and a receiver whose float
kernels round the decode differently (int8's rotation is a BLAS matmul: AVX2
and AVX kernels give different bits) still completes the handoff; a changed
body is still caught.
"""

from __future__ import annotations

import dataclasses
import random

import msgpack
import numpy as np
import pytest

from mlxcel_plugin.builtin_plugin import builtin_codecs
from mlxcel_plugin.kv_serde import (
    ChecksumMismatch,
    HandoffHeader,
    KVAssembler,
    KVMessage,
    MalformedHandoff,
    SerializableCacheState,
)
from mlxcel_plugin.kv_serde.header import (
    BODY_CHECKSUM_SERDE_VERSION,
    CHECKSUM_OF_ENCODED,
    CHECKSUM_OF_HELD,
    SUPPORTED_SERDE_VERSIONS,
)
from mlxcel_plugin.link.protocol.checksum import crc32, crc32_combine
from mlxcel_plugin.nodes.kv_wire import announce_serde_versions, announced_serde_versions
from mlxcel_plugin.testing.caches import make_cache, make_fingerprint, make_header

pytestmark = pytest.mark.skipif(crc32_combine is None, reason="needs ISA-L's crc32_combine")

FP = make_fingerprint(num_layers=3, kv_heads=2, head_dim=64, dtype="float16")
TOKENS = 300


class CountingCodec:
    """A codec that counts its decodes and can round them differently (another CPU's BLAS)."""

    def __init__(self, inner, nudge: bool = False):
        self.inner, self.nudge, self.decodes = inner, nudge, 0
        self.name, self.lossless, self.profile = inner.name, inner.lossless, inner.profile

    def encode(self, array, dtype, layout=None):
        return self.inner.encode(array, dtype, layout)

    def decode(self, data, meta, shape, dtype):
        self.decodes += 1
        out = self.inner.decode(data, meta, shape, dtype)
        if self.nudge:  # one element one ulp away, as a differently rounding kernel gives
            flat = out.reshape(-1)
            flat[-1] = np.nextafter(flat[-1], np.inf, dtype=flat.dtype)
        return out


def codecs_with(codec) -> dict:
    return {**builtin_codecs(), codec.name: codec}


def handoff(checksum_of: str, sender_codec) -> tuple[list[KVMessage], HandoffHeader]:
    header = dataclasses.replace(make_header(FP, TOKENS, codec="int8"), checksum_of=checksum_of)
    state = SerializableCacheState(header, make_cache(FP, TOKENS))
    return state.to_messages(sender_codec, 4096), header


def on_the_wire(message: KVMessage) -> KVMessage:
    header = msgpack.unpackb(msgpack.packb(message.header, use_bin_type=True), raw=False)
    return dataclasses.replace(message, header=header, body=bytes(message.body))


def assemble(messages, receiver_codec):
    assembler = KVAssembler(FP, codecs_with(receiver_codec))
    result = None
    for message in messages:
        result = assembler.feed(on_the_wire(message)) or result
    return result


def test_the_sender_skips_its_own_decode_and_checksums_each_tensors_bodies_in_row_order():
    sender = CountingCodec(builtin_codecs()["int8"])
    messages, _ = handoff(CHECKSUM_OF_ENCODED, sender)
    assert sender.decodes == 0
    chunks = [m for m in messages if m.kind == "chunk"]
    end = next(m for m in messages if m.kind == "end")
    for layer in range(FP.num_layers):
        for position, tensor in enumerate(("k", "v")):
            bodies = sorted((m.header["row"], bytes(m.body)) for m in chunks
                            if m.header["layer"] == layer and m.header["tensor"] == tensor)
            assert end.header["checksums"][layer][position] == crc32(
                b"".join(body for _, body in bodies))
    held_sender = CountingCodec(builtin_codecs()["int8"])
    handoff(CHECKSUM_OF_HELD, held_sender)
    assert held_sender.decodes == len(chunks)  # the first format decodes every chunk


def test_a_receiver_rounding_differently_completes_only_with_body_checksums():
    int8 = builtin_codecs()["int8"]
    messages, _ = handoff(CHECKSUM_OF_HELD, int8)
    with pytest.raises(ChecksumMismatch):
        assemble(messages, CountingCodec(int8, nudge=True))
    messages, _ = handoff(CHECKSUM_OF_ENCODED, int8)
    state = assemble(messages, CountingCodec(int8, nudge=True))
    assert state is not None and state.header.checksum_of == CHECKSUM_OF_ENCODED
    same = assemble(messages, int8)
    nudged = state.cache.layers[0].keys.astype(np.float32)
    plain = same.cache.layers[0].keys.astype(np.float32)
    differs = nudged != plain  # each chunk's last element, one ulp up: what was adopted
    assert differs.any() and differs.mean() < 0.01 and np.allclose(nudged, plain, rtol=1e-2)


def test_chunks_arriving_out_of_order_still_check_and_a_changed_body_fails():
    int8 = builtin_codecs()["int8"]
    messages, _ = handoff(CHECKSUM_OF_ENCODED, int8)
    begin, *chunks, end = messages
    shuffled = list(chunks)
    random.Random(3).shuffle(shuffled)
    assert assemble([begin, end, *shuffled], int8) is not None
    assert assemble([begin, *shuffled, end], int8) is not None
    body = bytearray(chunks[1].body)
    body[-1] ^= 0x01  # a code one step off: decodes fine, is not what was sent
    changed = [begin, chunks[0], dataclasses.replace(chunks[1], body=bytes(body)),
               *chunks[2:], end]
    with pytest.raises(ChecksumMismatch):
        assemble(changed, int8)


def test_body_checksums_travel_as_serde_version_3_and_are_refused_below_it():
    message = dataclasses.replace(make_header(FP, TOKENS, codec="int8"),
                                  checksum_of=CHECKSUM_OF_ENCODED).to_message()
    assert message.header["version"] == BODY_CHECKSUM_SERDE_VERSION == 3
    assert message.header["checksum_of"] == "encoded"
    assert HandoffHeader.from_message(message).checksum_of == CHECKSUM_OF_ENCODED
    held = make_header(FP, TOKENS, codec="int8").to_message()
    assert "checksum_of" not in held.header and held.header["version"] == 1  # first format
    assert HandoffHeader.from_message(held).checksum_of == CHECKSUM_OF_HELD
    for changes, error in (({"version": 2}, "needs serde version 3"),
                           ({"checksum_of": "decoded"}, "must be 'held', 'encoded' or 'none'")):
        changed = dataclasses.replace(message, header={**message.header, **changes})
        with pytest.raises(MalformedHandoff, match=error):
            HandoffHeader.from_message(changed)


def test_nodes_announce_the_versions_they_take_and_read_only_well_formed_ones():
    assert announced_serde_versions({"kv_serde": announce_serde_versions()}) == frozenset(
        SUPPORTED_SERDE_VERSIONS)
    assert BODY_CHECKSUM_SERDE_VERSION in SUPPORTED_SERDE_VERSIONS
    assert announced_serde_versions({}) == frozenset()  # a node from before the announcement
    assert announced_serde_versions({"kv_serde": "1, 2,x,-3"}) == {1, 2}
