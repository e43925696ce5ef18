"""Layers handed to the engine's adopter as each completes; checksums match zlib's crc32."""

from __future__ import annotations

import dataclasses
import gc
import weakref
import zlib

import numpy as np
import pytest

from mlxcel_plugin.builtin_plugin import builtin_codecs
from mlxcel_plugin.engine_api import CacheLayer, kv_buffer_maker, layer_adopter
from mlxcel_plugin.errors import HandoffError
from mlxcel_plugin.kv_codecs import resolve_codec
from mlxcel_plugin.kv_serde import (
    AdoptFailed,
    AssemblerLimits,
    BufferPool,
    KVAssembler,
    ReceiveMemory,
    SerializableCacheState,
)
from mlxcel_plugin.kv_serde.layer_buffers import LayerStock
from mlxcel_plugin.link.protocol.checksum import crc32
from mlxcel_plugin.testing.caches import (
    assert_caches_equal,
    make_cache,
    make_fingerprint,
    make_header,
)

CODECS = builtin_codecs()
FP = make_fingerprint(num_layers=3, kv_heads=2, head_dim=64, dtype="float16")
TOKENS = 300


@dataclasses.dataclass
class CopyingAdopter:
    """Stands in for an engine's adopt_layer: copies, and records what it was given."""

    seen: list[CacheLayer] = dataclasses.field(default_factory=list)

    def __call__(self, layer: CacheLayer) -> CacheLayer:
        self.seen.append(layer)
        return copy_layer(layer)


def copy_layer(layer: CacheLayer) -> CacheLayer:
    return dataclasses.replace(layer, keys=layer.keys.copy(), values=layer.values.copy())


def handoff(codec: str = "none"):
    cache = make_cache(FP, TOKENS, seed=3)
    state = SerializableCacheState(make_header(FP, TOKENS, codec=codec), cache)
    return state.to_messages(resolve_codec(codec, CODECS), chunk_bytes=8192), cache


def test_each_layer_is_adopted_once_as_soon_as_it_is_whole():
    messages, cache = handoff()
    adopter = CopyingAdopter()
    assembler = KVAssembler(FP, CODECS, adopt=adopter)
    for message in messages[:-1]:  # everything but end
        assembler.feed(message)
        complete = {m.header["layer"] for m in messages[1 : messages.index(message) + 1]}
        assert len(adopter.seen) <= len(complete)
    assert len(adopter.seen) == FP.num_layers
    for seen, sent in zip(adopter.seen, cache.layers, strict=True):
        np.testing.assert_array_equal(seen.keys, sent.keys)
        np.testing.assert_array_equal(seen.values, sent.values)
    result = assembler.feed(messages[-1])
    assert_caches_equal(result.cache, cache)
    assert all(a is not s.keys for a, s in zip(result.cache.layers, adopter.seen, strict=True))


def test_the_handoff_holds_what_the_adopter_returned():
    messages, cache = handoff()
    returned = []

    def adopt(layer: CacheLayer) -> CacheLayer:
        returned.append(dataclasses.replace(layer, meta={**layer.meta, "adopted": True}))
        return returned[-1]

    assembler = KVAssembler(FP, CODECS, adopt=adopt)
    result = [r for r in map(assembler.feed, messages) if r is not None][0]
    assert result.cache.layers == returned


def test_receive_buffers_go_back_to_the_pool_once_a_layer_is_adopted():
    messages, _ = handoff()
    pool = BufferPool()
    assembler = KVAssembler(FP, CODECS, memory=ReceiveMemory(pool), adopt=copy_layer)
    layer0 = [m for m in messages if m.kind == "begin" or m.header.get("layer") == 0]
    for message in layer0:
        assembler.feed(message)
    assert pool.reused == 0
    first_of_layer1 = next(m for m in messages if m.header.get("layer") == 1)
    assembler.feed(first_of_layer1)
    assert pool.reused == 2  # layer 1's K and V took layer 0's slabs, before the handoff ended


def test_lossy_codecs_are_adopted_too():
    messages, _ = handoff("int8")
    adopter = CopyingAdopter()
    assembler = KVAssembler(FP, CODECS, adopt=adopter)
    result = [r for r in map(assembler.feed, messages) if r is not None][0]
    assert len(adopter.seen) == FP.num_layers and result.cache.layers[0].keys.shape[2] == TOKENS


def test_an_adopter_failure_fails_the_handoff_with_a_named_error():
    messages, _ = handoff()

    def adopt(layer: CacheLayer) -> CacheLayer:
        raise MemoryError("no room")

    assembler = KVAssembler(FP, CODECS, adopt=adopt)
    with pytest.raises(AdoptFailed, match="MemoryError") as failure:
        for message in messages:
            assembler.feed(message)
    assert failure.value.code == "handoff_adopt_failed"
    assert assembler.allocated_bytes == 0


@dataclasses.dataclass
class EngineMemory:
    """Stands in for an engine's kv_buffers: hands out (and records) arrays it owns."""

    made: list[np.ndarray] = dataclasses.field(default_factory=list)
    calls: int = 0

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype, count: int) -> list[np.ndarray]:
        self.calls += 1
        self.made += [np.empty(shape, dtype=dtype) for _ in range(count)]
        return self.made[-count:]


def test_layers_are_received_into_the_engines_buffers():
    messages, cache = handoff()
    memory, adopter, pool = EngineMemory(), CopyingAdopter(), BufferPool()
    assembler = KVAssembler(FP, CODECS, memory=ReceiveMemory(pool, memory), adopt=adopter)
    result = [r for r in map(assembler.feed, messages) if r is not None][0]
    assert len(memory.made) == 2 * FP.num_layers and pool.held_bytes == 0
    for seen in adopter.seen:
        assert any(seen.keys is made for made in memory.made)
        assert any(seen.values is made for made in memory.made)
    assert_caches_equal(result.cache, cache)


def test_a_handoffs_layers_take_the_engines_buffers_in_one_call_within_the_budget():
    """Each call to the engine's buffer maker is a hop to MLX's threads: the first layer takes
    the K and V of every later layer of its shape too, never more than the budget holds."""
    messages, cache = handoff()
    memory = EngineMemory()
    limits = AssemblerLimits(max_bytes=FP.kv_bytes(TOKENS))  # exactly the handoff
    assembler = KVAssembler(FP, CODECS, limits, memory=ReceiveMemory(make_buffers=memory),
                            adopt=CopyingAdopter())
    result = [r for r in map(assembler.feed, messages) if r is not None][0]
    assert memory.calls == 1 and len(memory.made) == 2 * FP.num_layers
    assert sum(b.nbytes for b in memory.made) <= limits.max_bytes
    assert_caches_equal(result.cache, cache)


def test_the_begin_readies_every_plain_layers_buffers_and_the_chunks_land_in_them():
    """A plain K/V layer's shape follows from the begin: its buffers are taken then (while the
    sender's prefill runs), so the first chunk finds them ready and no chunk allocates."""
    messages, cache = handoff()
    memory, adopter = EngineMemory(), CopyingAdopter()
    assembler = KVAssembler(FP, CODECS, memory=ReceiveMemory(make_buffers=memory), adopt=adopter)
    assembler.feed(messages[0])  # the begin
    assert memory.calls == 1 and len(memory.made) == 2 * FP.num_layers
    assert assembler.allocated_bytes == sum(b.nbytes for b in memory.made)
    result = [r for r in map(assembler.feed, messages[1:]) if r is not None][0]
    assert memory.calls == 1
    landed = {id(b) for b in memory.made}
    assert all({id(seen.keys), id(seen.values)} <= landed for seen in adopter.seen)
    assert_caches_equal(result.cache, cache)


def test_a_layer_its_sender_describes_otherwise_than_the_begin_implies_is_allocated_anew():
    messages, cache = handoff()
    for message in messages:  # layer 1 arrives with meta the begin could not foresee
        if message.kind == "chunk" and message.header["layer"] == 1:
            message.header["layer_meta"] = {"from": "elsewhere"}
    memory = EngineMemory()
    assembler = KVAssembler(FP, CODECS, memory=ReceiveMemory(make_buffers=memory))
    assembler.feed(messages[0])
    readied = [weakref.ref(b) for b in memory.made]
    layer_bytes = assembler.allocated_bytes // FP.num_layers
    memory.made.clear()
    result = [r for r in map(assembler.feed, messages[1:]) if r is not None][0]
    gc.collect()
    assert memory.calls == 2 and len(memory.made) == 2  # layer 1's own K and V
    assert sum(ref() is None for ref in readied) == 2  # what was readied for it is let go
    assert assembler.allocated_bytes == FP.num_layers * layer_bytes  # the readied one's went
    assert result.cache.layers[1].meta == {"from": "elsewhere"}
    assert [(layer.keys.tobytes(), layer.values.tobytes()) for layer in result.cache.layers] == [
        (layer.keys.tobytes(), layer.values.tobytes()) for layer in cache.layers]


def test_a_refused_handoff_drops_the_buffers_taken_ahead():
    messages, _ = handoff()
    memory = EngineMemory()
    assembler = KVAssembler(FP, CODECS, memory=ReceiveMemory(make_buffers=memory))
    first_chunk = next(i for i, m in enumerate(messages) if m.kind == "chunk")
    for message in messages[: first_chunk + 1]:
        assembler.feed(message)
    assert len(memory.made) == 2 * FP.num_layers  # layer 0's and the later layers'
    taken_ahead = [weakref.ref(b) for b in memory.made[2:]]
    memory.made.clear()
    with pytest.raises(HandoffError):
        assembler.feed(messages[first_chunk])  # the same chunk again: refused
    gc.collect()
    assert all(ref() is None for ref in taken_ahead)


def test_buffers_taken_ahead_for_a_shape_no_later_layer_asks_for_are_dropped():
    """Memory in hand stays within what the budget counted: a layer of another shape drops
    what was taken ahead before it takes its own."""
    memory = EngineMemory()
    stock = LayerStock(ReceiveMemory(make_buffers=memory))
    first = stock.take((1, 2, 8, 4), np.dtype(np.float16), 2, lambda: 3)
    assert len(memory.made) == 8 and stock.held_bytes == 6 * first[0].nbytes
    unused = [weakref.ref(b) for b in memory.made[2:]]
    memory.made.clear()
    other = stock.take((1, 2, 16, 4), np.dtype(np.float16), 2, lambda: 1)
    gc.collect()
    assert all(ref() is None for ref in unused)
    assert stock.held_bytes == 2 * other[0].nbytes
    again = stock.take((1, 2, 16, 4), np.dtype(np.float16), 2)
    assert [id(b) for b in again] == [id(b) for b in memory.made[2:]]  # the ones taken ahead
    assert stock.held_bytes == 0 and memory.calls == 2


@pytest.mark.parametrize(
    "make_one",
    [
        lambda shape, dtype: np.empty(shape[:-1], dtype=dtype),  # wrong shape
        lambda shape, dtype: np.empty(shape, dtype=np.float32),  # wrong dtype
        lambda shape, dtype: np.empty(shape[:-1] + (2 * shape[-1],), dtype=dtype)[..., ::2],
        lambda shape, dtype: np.broadcast_to(np.zeros(1, dtype=dtype), shape),  # read-only
        lambda shape, dtype: None,  # too few
    ],
    ids=["shape", "dtype", "strided", "read-only", "count"],
)
def test_an_unusable_engine_buffer_fails_the_handoff_with_a_named_error(make_one):
    def make_buffers(shape, dtype, count):
        made = [make_one(shape, dtype) for _ in range(count)]
        return [b for b in made if b is not None]

    messages, _ = handoff()
    assembler = KVAssembler(FP, CODECS, memory=ReceiveMemory(make_buffers=make_buffers))
    with pytest.raises(AdoptFailed, match="receive buffer"):
        for message in messages:
            assembler.feed(message)
    assert assembler.allocated_bytes == 0


def test_an_engine_out_of_receive_memory_fails_only_that_handoff():
    messages, cache = handoff()

    def no_memory(shape: tuple[int, ...], dtype: np.dtype, count: int) -> list[np.ndarray]:
        raise MemoryError("no room")

    starved = KVAssembler(FP, CODECS, memory=ReceiveMemory(make_buffers=no_memory))
    with pytest.raises(AdoptFailed, match="MemoryError"):
        for message in messages:
            starved.feed(message)
    healthy = KVAssembler(FP, CODECS, memory=ReceiveMemory(make_buffers=EngineMemory()))
    result = [r for r in map(healthy.feed, messages) if r is not None][0]
    assert_caches_equal(result.cache, cache)


def test_engines_without_kv_buffers_get_none():
    class NumpyEngine:
        pass

    class MemoryEngine:
        def kv_buffers(self, shape: tuple[int, ...], dtype: np.dtype, count: int) -> list:
            return [np.empty(shape, dtype=dtype) for _ in range(count)]

    assert kv_buffer_maker(NumpyEngine()) is None
    engine = MemoryEngine()
    assert kv_buffer_maker(engine) == engine.kv_buffers


def test_engines_without_adopt_layer_get_none():
    class NumpyEngine:
        pass

    class AdoptingEngine:
        def adopt_layer(self, layer: CacheLayer) -> CacheLayer:
            return layer

    assert layer_adopter(NumpyEngine()) is None
    engine = AdoptingEngine()
    assert layer_adopter(engine) == engine.adopt_layer


@pytest.mark.parametrize("size", [0, 1, 5000, 1 << 20])
def test_checksum_is_zlibs_crc32(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data[size // 2 :], crc32(data[: size // 2])) == zlib.crc32(data)


def land_all(assembler, messages, crc_of=zlib.crc32):
    """Feed as the decode node does: raw chunk bodies written in place, with their landed crc."""
    state = None
    for message in messages:
        into = assembler.chunk_destination(message.header) if message.kind == "chunk" else None
        if into is not None:
            into[:] = message.body
            message = dataclasses.replace(message, body=into, body_crc=crc_of(message.body))
        state = assembler.feed(message) or state
    return state


@pytest.mark.parametrize("combine", [True, False], ids=["combined", "isal-missing"])
def test_tensor_checksums_combine_the_crcs_taken_as_chunks_landed(monkeypatch, combine):
    from mlxcel_plugin.kv_serde import received_layer

    if not combine:
        monkeypatch.setattr(received_layer, "crc32_combine", None)
    messages, cache = handoff()  # 8 KiB chunks: several per tensor
    assert sum(m.kind == "chunk" for m in messages) > 2 * FP.num_layers
    state = land_all(KVAssembler(FP, CODECS), messages)
    assert_caches_equal(state.cache, cache)


def test_a_landed_crc_that_disagrees_with_the_sender_fails_the_handoff():
    from mlxcel_plugin.kv_serde import ChecksumMismatch

    messages, _ = handoff()
    with pytest.raises(ChecksumMismatch):
        land_all(KVAssembler(FP, CODECS), messages, crc_of=lambda body: zlib.crc32(body) ^ 1)


def test_a_crc_for_a_body_that_did_not_land_in_place_is_not_trusted():
    messages, cache = handoff()
    assembler = KVAssembler(FP, CODECS)
    state = None
    for message in messages:  # bodies elsewhere: copied into place, crc read from the buffer
        state = assembler.feed(dataclasses.replace(message, body_crc=12345)) or state
    assert_caches_equal(state.cache, cache)


def test_room_sizes_sit_on_a_grid_an_eighth_of_an_octave_apart():
    """Receive buffers are sized so that prompts of nearby lengths share a size (MLX reuses
    a freed buffer only for an allocation of about its size): past the tokens, whole steps,
    at most an eighth more than asked beyond the step."""
    from mlxcel_plugin.kv_serde.layer_buffers import room_grid

    step = 256
    assert [room_grid(t, step) for t in (1, 256, 257, 2049, 4097, 8193, 32769)] == [
        256, 256, 512, 2304, 4608, 9216, 36864]
    sizes = {room_grid(t, step) for t in range(8193, 9217)}
    assert sizes == {9216}  # a thousand prompt lengths, one buffer size
    for tokens in range(1, 70000, 97):
        room = room_grid(tokens, step)
        assert room >= tokens and room % step == 0
        assert room <= max(tokens * 9 / 8, tokens) + step
