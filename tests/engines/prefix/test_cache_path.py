"""The prefix cache adds no copy to a request's first-token path (engines/prefix/cache.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from engines.mlx_engine import MlxEngine
from engines.model_loader import load_mlx_model
from engines.prefill import run_prefill
from engines.prefix.cache import PrefixCache
from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest, PrefixCacheConfig
from tests.engines import support

CHUNK = 64


def tokens(n: int, seed: int) -> tuple[int, ...]:
    rng = np.random.default_rng(seed)
    return tuple(int(t) for t in rng.integers(3, 49152, n))


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return load_mlx_model(str(tiny_model_path))[0]


def prefilled(model, prompt: tuple[int, ...]) -> list:
    caches = make_prompt_cache(model)
    run_prefill(model, prompt, caches, CHUNK)
    return caches


def snapshot(caches: list) -> list[np.ndarray]:
    return [np.array(c.keys[..., : c.offset, :]) for c in caches]


def test_a_hit_reads_the_entry_in_place_and_extending_it_leaves_the_entry_alone(model):
    prompt = tokens(300, seed=1)
    cache = PrefixCache(1 << 30, CHUNK)
    cache.store_prompt(prompt, prefilled(model, prompt))
    entry = cache._lru._trie.get("model", list(prompt[:256])).prompt_cache
    before = snapshot(entry)
    hit = cache.lookup(prompt + tokens(40, seed=2))
    assert hit.reused_tokens == 256
    # Views of the entry's memory, not copies...
    assert hit.caches[0].keys.shape[2] == 256 and hit.caches[0].keys is not entry[0].keys
    longer = prompt + tokens(40, seed=2)
    logits = run_prefill(model, longer, hit.caches, CHUNK)
    # ...that the prefill extends into its own buffer: the entry reads as before,
    for held, was in zip(snapshot(entry), before, strict=True):
        assert np.array_equal(held, was)
    # and the logits are a cache-off run's.
    plain = run_prefill(model, longer, make_prompt_cache(model), CHUNK)
    assert bool(mx.array_equal(logits, plain).item())


def test_store_prompt_later_stores_nothing_until_store_pending(model):
    prompt = tokens(200, seed=3)
    cache = PrefixCache(1 << 30, CHUNK)
    cache.store_prompt_later(prompt, prefilled(model, prompt))
    assert cache.stats().entries == 0
    cache.store_pending()
    assert cache.stats().entries == 1
    assert cache.lookup(prompt + (5, 6)).reused_tokens == 192
    cache.store_pending()  # drained: nothing stored twice
    assert cache.stats().entries == 1


def test_a_prefill_only_jobs_caches_are_stored_without_a_copy(model):
    """On a prefill node nothing decodes the caches: the entry is their own memory (no pass
    over the K/V while it is handed off), and it still reads as the prompt's."""
    prompt = tokens(200, seed=5)
    caches = prefilled(model, prompt)
    before = snapshot(caches)
    cache = PrefixCache(1 << 30, CHUNK)
    cache.store_prompt_later(prompt, caches)
    cache.store_pending(adopt=True)
    entry = cache._lru._trie.get("model", list(prompt[:192])).prompt_cache
    assert all(c.keys is held.keys for c, held in zip(entry, caches, strict=True))
    for held, was in zip(snapshot(entry), before, strict=True):
        assert np.array_equal(held, was[..., :192, :])
    assert cache.lookup(prompt + (5, 6)).reused_tokens == 192


def received(caches: list) -> list:
    """As a handoff arrives: KVCaches whose buffers end at their offsets."""
    out = []
    for cache in caches:
        full = KVCache()
        full.state = (mx.contiguous(cache.keys[..., : cache.offset, :]),
                      mx.contiguous(cache.values[..., : cache.offset, :]), cache.offset)
        out.append(full)
    mx.eval([c.state for c in out])
    return out


def test_a_received_cache_is_stored_as_views_and_decoding_leaves_the_entry_alone(model):
    """No copy of a handed-off cache on the decode node's engine thread: the entry reads the
    received arrays, and the sequence's first steps grow into buffers of their own."""
    prompt = tokens(200, seed=6)
    caches = received(prefilled(model, prompt))
    cache = PrefixCache(1 << 30, CHUNK)
    cache.store_received(prompt, caches, share_min_bytes=0)
    entry = cache._lru._trie.get("model", list(prompt[:192])).prompt_cache
    for stored, held in zip(entry, caches, strict=True):
        assert np.shares_memory(np.array(stored.keys, copy=False), np.array(held.keys, copy=False))
    before = snapshot(entry)
    for held in caches:  # a decode step writes position 200 of every layer
        step = mx.ones((1, held.keys.shape[1], 1, held.keys.shape[3]), dtype=held.keys.dtype)
        held.update_and_fetch(step, step)
    mx.eval([c.state for c in caches])
    for held, was in zip(snapshot(entry), before, strict=True):
        assert np.array_equal(held, was)
    assert cache.lookup(prompt + (5, 6)).reused_tokens == 192


def test_a_received_cache_with_room_is_shared_and_decoding_writes_it_in_place(model):
    """A cache received with room (engines/kv_room.py) goes on decoding into its own
    buffers: the entry holds the same arrays, not slices, which would make MLX copy them."""
    prompt = tokens(200, seed=7)
    caches = prefilled(model, prompt)  # its buffers have room past the prompt
    assert all(c.keys.shape[2] > c.offset for c in caches)
    cache = PrefixCache(1 << 30, CHUNK)
    cache.store_received(prompt, caches, share_min_bytes=0)
    entry = cache._lru._trie.get("model", list(prompt[:192])).prompt_cache
    assert all(e.keys is c.keys and e.values is c.values for e, c in zip(entry, caches,
                                                                         strict=True))
    before = snapshot(entry)
    where = [np.array(c.keys, copy=False).ctypes.data for c in caches]
    for held in caches:  # a decode step writes position 200 of every layer
        step = mx.ones((1, held.keys.shape[1], 1, held.keys.shape[3]), dtype=held.keys.dtype)
        held.update_and_fetch(step, step)
    mx.eval([c.state for c in caches])
    assert [np.array(c.keys, copy=False).ctypes.data for c in caches] == where  # in place
    for held, was in zip(snapshot(entry), before, strict=True):
        assert np.array_equal(held, was)
    assert cache.lookup(prompt + (5, 6)).reused_tokens == 192


def test_a_small_received_cache_is_copied(model):
    prompt = tokens(200, seed=7)
    caches = received(prefilled(model, prompt))  # its slab is shared with other handoffs
    cache = PrefixCache(1 << 30, CHUNK)
    cache.store_received(prompt, caches, share_min_bytes=1 << 30)
    entry = cache._lru._trie.get("model", list(prompt[:192])).prompt_cache
    assert not np.shares_memory(np.array(entry[0].keys, copy=False),
                                np.array(caches[0].keys, copy=False))


def test_store_finished_adopts_the_caches_it_is_handed(model):
    held = tokens(150, seed=4)
    caches = prefilled(model, held)
    cache = PrefixCache(1 << 30, CHUNK, reuse_generated=True)
    cache.store_finished(held, caches)
    assert cache._lru._trie.get("model", list(held)).prompt_cache is caches
    assert cache.stats().cached_bytes == sum(c.nbytes for c in caches)  # spare capacity too


def test_the_first_token_is_emitted_before_the_prompt_is_stored(tiny_model_path):
    prefix = PrefixCacheConfig(max_bytes=1 << 30)
    eng = MlxEngine.from_path(str(tiny_model_path),
                              EngineConfig(chunk_size_tokens=CHUNK, prefix_cache=prefix))
    eng.start()
    entries_at_first_token: list[int] = []
    events = support.Events()

    def emit(event) -> None:
        if event.index == 0:  # on the engine thread, as the first token goes out
            entries_at_first_token.append(eng._prefix.stats().entries)
        events(event)

    try:
        eng.generate(GenerationRequest("r", tokens(200, seed=5), 3), emit)
        events.wait()
        assert entries_at_first_token == [0]
        assert eng.stats().prefix_cache.entries == 1
    finally:
        eng.close()
