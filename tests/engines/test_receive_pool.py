"""The decode node's receive pool (docs/bulk-lanes.md#receive-pool): received K/V land in
MLX memory that a finished handoff left faulted in, on sizes a grid shares, within the KV budget.

Bytes and addresses are compared, never timings: a handoff lands bit for bit whether
its buffers are reused or fresh, and the next handoff of a nearby length reuses the
very memory the last one freed.
"""

from __future__ import annotations

import dataclasses
import gc

import mlx.core as mx
import numpy as np
import pytest

from engines import kv_convert
from engines.engine_memory import EngineMemory, model_bytes, warm_bytes
from engines.synthetic_kv import load_synthetic_model, write_synthetic_checkpoint
from mlxcel_plugin.builtin_plugin import builtin_codecs
from mlxcel_plugin.cache_lines import CACHE_LINE_BYTES
from mlxcel_plugin.engine_api import EngineConfig
from mlxcel_plugin.kv_serde import KVAssembler, ReceiveMemory
from mlxcel_plugin.kv_serde.header import CHECKSUM_OF_NONE
from mlxcel_plugin.kv_serde.pool import receive_pool_bytes_for
from mlxcel_plugin.kv_serde.state import SerializableCacheState
from mlxcel_plugin.testing.caches import make_cache, make_fingerprint, make_header
from tests.engines.test_kv_room import land

MIB, GIB = 1 << 20, 1 << 30
# An 8B model's layer (8 KV heads, head_dim 128, bf16), two of them: 9 MiB a tensor.
EIGHT_B = make_fingerprint(num_layers=2, kv_heads=8, head_dim=128, dtype="bfloat16")


@pytest.fixture
def cache_limit():
    """MLX's cache limit for the test, restored after (other tests run in this process).

    The cache starts empty: buffers earlier tests left in it (garbage collected now
    included) could otherwise be the ones a handoff of the same size takes."""
    previous = mx.set_cache_limit(GIB)
    gc.collect()
    mx.clear_cache()
    yield
    mx.set_cache_limit(previous)
    mx.clear_cache()


def receive(tokens: int, seed: int):
    """A v4 handoff of ``tokens`` through the MLX engine's receive buffers (room included),
    landed chunk by chunk as the link does; (sent cache, rebuilt mlx-lm caches)."""
    sent = make_cache(EIGHT_B, tokens, seed=seed)
    header = dataclasses.replace(make_header(EIGHT_B, tokens, handoff_id=f"h-{seed}"),
                                 checksum_of=CHECKSUM_OF_NONE)
    messages = SerializableCacheState(header, sent).to_messages(builtin_codecs()["none"], 1 << 20)
    assembler = KVAssembler(EIGHT_B, builtin_codecs(), adopt=kv_convert.adopt_layer,
                            memory=ReceiveMemory(make_buffers=kv_convert.ReceiveBuffers()))
    from mlxcel_plugin.nodes.kv_wire import frame_to_messages, frames_for

    state = None
    for _, frame in frames_for(messages):
        for message in frame_to_messages(land(assembler, frame)):
            state = assembler.feed(message) or state
    assert state is not None
    return sent, kv_convert.from_cache_state(state.cache)


def addresses(caches) -> set[int]:
    arrays = [a.view(mx.uint16) for c in caches for a in (c.keys, c.values)]
    mx.eval(arrays)
    return {np.array(a, copy=False).ctypes.data for a in arrays}


def assert_holds(caches, sent, tokens: int) -> None:
    for cache, want in zip(caches, sent.layers, strict=True):
        keys = np.array(cache.keys[..., :tokens, :].view(mx.uint16))
        values = np.array(cache.values[..., :tokens, :].view(mx.uint16))
        assert np.array_equal(keys, want.keys) and np.array_equal(values, want.values)


def test_a_handoff_lands_bit_for_bit_in_the_memory_the_last_one_left_warm(cache_limit):
    sent, caches = receive(4400, seed=1)
    assert [c.keys.shape[2] for c in caches] == [4608, 4608]  # 4400 -> the grid's 4608
    assert_holds(caches, sent, 4400)
    first = addresses(caches)
    del caches
    gc.collect()
    assert warm_bytes() >= 4 * 9 * MIB  # the freed receive buffers stay in MLX's cache
    # 4200 tokens sits in the same grid cell (a 256-token step alone would be 4352): the
    # next handoff reuses that memory, and still holds exactly what was sent.
    sent, caches = receive(4200, seed=2)
    assert [c.keys.shape[2] for c in caches] == [4608, 4608]
    assert addresses(caches) == first
    assert_holds(caches, sent, 4200)


def test_a_handoff_larger_than_the_pool_still_lands_bit_for_bit(cache_limit):
    mx.set_cache_limit(0)  # a pool of nothing: every buffer comes fresh from the OS
    mx.clear_cache()
    for seed, tokens in ((3, 4400), (4, 4200)):
        sent, caches = receive(tokens, seed)
        assert_holds(caches, sent, tokens)
        del caches
        gc.collect()
        assert warm_bytes() == 0


def test_the_pool_never_exceeds_the_kv_budget():
    assert receive_pool_bytes_for(8 * GIB, machine_bytes=64 * GIB) == 2 * GIB  # the cap
    assert receive_pool_bytes_for(1 * GIB, machine_bytes=64 * GIB) == 256 * MIB  # a quarter
    assert receive_pool_bytes_for(8 * GIB, model_bytes=14 * GIB,
                                  machine_bytes=16 * GIB) == 256 * MIB  # an eighth of 2 GiB
    assert receive_pool_bytes_for(512 * MIB, asked_bytes=3 * GIB) == 512 * MIB  # clamped
    assert receive_pool_bytes_for(8 * GIB, asked_bytes=3 * GIB) == 3 * GIB  # as asked
    assert receive_pool_bytes_for(32 * MIB, machine_bytes=64 * GIB) == 32 * MIB


def test_the_engine_bounds_mlxs_cache_by_the_receive_pool(tmp_path):
    model, _ = load_synthetic_model(write_synthetic_checkpoint(tmp_path / "m", layers=2,
                                                               kv_heads=2, head_dim=64))
    previous = mx.set_cache_limit(0)
    try:
        config = EngineConfig(kv_memory_bytes=2 * GIB, receive_pool_bytes=768 * MIB)
        memory = EngineMemory(model_bytes(model), config)
        memory.apply()
        assert memory.receive_pool_bytes == memory.cache_limit_bytes == 768 * MIB
        assert mx.set_cache_limit(768 * MIB) == 768 * MIB  # the limit in force
        # What a decode node's /metrics reads (mlxcel:receive_pool_*_bytes).
        assert kv_convert.ReceiveBuffers().pool_bytes() == (768 * MIB, warm_bytes())
        # Asked for more than the KV budget: held to the budget.
        smaller = dataclasses.replace(config, kv_memory_bytes=512 * MIB)
        memory = EngineMemory(model_bytes(model), smaller)
        assert memory.receive_pool_bytes == 512 * MIB
    finally:
        mx.set_cache_limit(previous)


def test_a_new_size_is_kept_warm_when_the_pool_is_full_of_another(cache_limit, monkeypatch):
    """MLX caches a freed buffer only while its cache has room: a pool filled by one prompt
    size used to keep every buffer of another out. A received cache makes room as it is
    freed (the oldest cached buffers go), so the next handoff reuses its memory."""
    from engines import cache_admission, engine_memory

    monkeypatch.setattr(cache_admission, "MIN_LAYER_BYTES", 0)  # these layers: 18 MiB

    limit = 160 * MIB
    mx.set_cache_limit(limit)
    monkeypatch.setattr(engine_memory, "_applied_cache_bytes", [limit])  # as apply() sets it
    stale = [mx.zeros((5 * MIB,), dtype=mx.uint8) for _ in range(limit // (5 * MIB))]
    mx.eval(stale)
    del stale
    assert warm_bytes() > limit - 10 * MIB  # full of buffers no handoff below can use
    sent, caches = receive(4400, seed=1)
    assert_holds(caches, sent, 4400)
    first = addresses(caches)
    del caches
    gc.collect()
    sent, caches = receive(4200, seed=2)
    assert addresses(caches) == first
    assert_holds(caches, sent, 4200)


def test_a_warm_handoff_stays_warm_after_other_buffers_fill_the_pool(cache_limit, monkeypatch):
    """Warm, then warm again: a handoff that took the last one's buffers frees them into a
    pool that running streams filled meanwhile; its cache makes room as it is freed, so the
    next handoff takes every buffer from the pool (warm bytes fall by all of its own)."""
    from engines import cache_admission, engine_memory

    monkeypatch.setattr(cache_admission, "MIN_LAYER_BYTES", 0)  # these layers: 18 MiB

    limit = 160 * MIB
    mx.set_cache_limit(limit)
    monkeypatch.setattr(engine_memory, "_applied_cache_bytes", [limit])
    sent, caches = receive(4400, seed=1)
    # Each buffer's allocation: its array and the cache line it may start into (cache_lines).
    handoff_bytes = sum(c.keys.nbytes + c.values.nbytes + 2 * CACHE_LINE_BYTES for c in caches)
    del caches
    gc.collect()
    sent, caches = receive(4200, seed=2)  # takes the buffers just freed
    assert_holds(caches, sent, 4200)
    second = addresses(caches)
    stale = [mx.zeros((5 * MIB,), dtype=mx.uint8) for _ in range(limit // (5 * MIB))]
    mx.eval(stale)
    del stale  # the streams' freed buffers: the pool is full again
    assert warm_bytes() > limit - 10 * MIB
    del caches
    gc.collect()
    before = warm_bytes()
    sent, caches = receive(4300, seed=3)
    assert before - warm_bytes() == handoff_bytes  # every buffer came from the pool
    assert addresses(caches) == second
    assert_holds(caches, sent, 4300)


def test_room_is_made_only_for_layers_of_the_bound_and_up(cache_limit, monkeypatch):
    """Each making waits for every CPU stream: small layers (here 18 MiB) are left to MLX."""
    from engines import cache_admission

    registered = []
    monkeypatch.setattr(cache_admission, "keep_warm_when_freed",
                        lambda cache, nbytes: registered.append(nbytes))
    receive(4400, seed=1)
    assert registered == []
    monkeypatch.setattr(cache_admission, "MIN_LAYER_BYTES", 18 * MIB)
    receive(4400, seed=2)
    assert registered == [18 * MIB, 18 * MIB]  # one per layer: its K and V with room
