"""The prefix cache on the tiny model: a hit gives the bytes of a cache-off run, within budget."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engines.mlx_engine import MlxEngine
from engines.prefix.cache import PrefixCache
from engines.prefix.grid import PrefillGrid
from mlxcel_plugin.engine_api import (
    EngineConfig,
    GenerationRequest,
    PrefixCacheConfig,
    SamplingParams,
)
from tests.engines import support

CHUNK = 256
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=99)


def tokens(n: int, seed: int) -> tuple[int, ...]:
    rng = np.random.default_rng(seed)
    return tuple(int(t) for t in rng.integers(3, 49152, n))


SHARED = tokens(1100, seed=1)  # a long "system prompt" spanning four full chunks


def make_engine(path, max_bytes: int, **config) -> MlxEngine:
    prefix = PrefixCacheConfig(max_bytes=max_bytes)
    eng = MlxEngine.from_path(
        str(path), EngineConfig(chunk_size_tokens=CHUNK, prefix_cache=prefix, **config)
    )
    eng.start()
    return eng


@pytest.fixture(scope="module")
def engines(tiny_model_path):
    cached, plain = make_engine(tiny_model_path, 1 << 30), make_engine(tiny_model_path, 0)
    yield cached, plain
    cached.close()
    plain.close()


def grid_of(engine: MlxEngine) -> PrefillGrid:
    """The grid the engine's start-up probe chose (any token here: MLX's reference BLAS)."""
    return PrefillGrid(CHUNK, engine.stats().prefix_cache.exact_min_rows or None)


def test_the_probe_allows_any_token_reuse_on_this_backend(engines):
    cached, plain = engines
    assert grid_of(cached).any_token and grid_of(plain) == grid_of(cached)


@pytest.mark.parametrize("extra", [1, 255, 256, 257, 600])
@pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_a_hit_generates_what_cache_off_generates(engines, extra, sampling):
    cached, plain = engines
    support.generate(cached, GenerationRequest("warm", SHARED + tokens(7, seed=2), 1))
    request = GenerationRequest(f"hit-{extra}", SHARED + tokens(extra, seed=extra), 12, sampling)
    hit = support.generate(cached, request)
    # At least the shared full chunks (the same prompt's own chunks once it ran greedy).
    assert hit.events[0].cached_tokens >= 1024
    assert hit.tokens == support.generate(plain, request).tokens


def test_the_prefill_role_reuses_and_reports_cached_tokens(engines):
    cached, plain = engines
    support.generate(cached, GenerationRequest("seed-prefix", SHARED + tokens(3, seed=3), 1))
    request = GenerationRequest("split", SHARED + tokens(300, seed=4), 10)
    result = support.prefill(cached, request)
    assert result.cached_tokens == grid_of(cached).usable(len(SHARED), len(request.prompt_tokens))
    assert support.decode_after(cached, request, result) == support.split(plain, request)
    assert support.prefill(plain, request).cached_tokens == 0


def test_a_multi_turn_conversation_hits_every_later_turn(engines):
    cached, plain = engines
    grid, history, asked = grid_of(cached), SHARED, 0
    for turn in range(4):
        history = history + tokens(90, seed=100 + turn)
        request = GenerationRequest(f"turn-{turn}", history, 8)
        got = support.generate(cached, request)
        assert got.tokens == support.generate(plain, request).tokens
        if turn:  # the previous prompt, as far as it is exact; not its reply
            assert got.events[0].cached_tokens == grid.usable(grid.exact_end(asked), len(history))
        history, asked = history + tuple(got.tokens), len(history)


def test_concurrent_requests_sharing_a_prefix_stay_exact(engines):
    cached, plain = engines
    requests = [GenerationRequest(f"c{i}", SHARED + tokens(40, seed=200 + i), 8) for i in range(4)]
    outcomes = [support.Events() for _ in requests]
    pairs = list(zip(requests, outcomes, strict=True))
    threads = [threading.Thread(target=cached.generate, args=pair) for pair in pairs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for request, outcome in pairs:
        assert outcome.wait()[-1].finish_reason is not None
        assert outcome.tokens == support.generate(plain, request).tokens


def stats_after(engine: MlxEngine, before: int, timeout_s: float = 10.0):
    """The prefix cache's stats once the engine thread's snapshot shows a lookup since
    ``before``: it refreshes them after the iteration whose step may already have
    delivered the request's last token."""
    deadline = time.monotonic() + timeout_s
    while True:  # bounded by the deadline
        stats = engine.stats().prefix_cache
        if stats.lookup_tokens != before or time.monotonic() > deadline:
            return stats
        time.sleep(0.01)


def test_stats_count_hits_lookups_and_bytes(engines):
    cached, _ = engines
    before = cached.stats().prefix_cache
    request = GenerationRequest("stats", SHARED + tokens(20, seed=5), 2)
    support.generate(cached, request)
    after = stats_after(cached, before.lookup_tokens)
    assert after.lookup_tokens - before.lookup_tokens == len(request.prompt_tokens)
    hit = grid_of(cached).usable(len(SHARED), len(request.prompt_tokens))
    assert after.hit_tokens - before.hit_tokens == hit
    assert after.cached_bytes > 0 and after.entries >= 1
    assert cached.stats().kv_bytes >= after.cached_bytes


def test_a_tiny_budget_evicts_instead_of_growing(tiny_model_path):
    one_entry = 2 * 1024 * 1024  # the tiny model's KV of 1024 tokens is ~1 MiB
    eng = make_engine(tiny_model_path, one_entry)
    try:
        for i in range(4):  # 2 tokens: the prompt is stored after the first is out
            support.generate(eng, GenerationRequest(f"e{i}", tokens(1100, seed=300 + i), 2))
            assert eng.stats().prefix_cache.cached_bytes <= one_entry
        stats = eng.stats().prefix_cache
        assert stats.evictions >= 2 and stats.entries >= 1
    finally:
        eng.close()


def test_cached_prefixes_are_evicted_before_a_request_is_refused(tiny_model_path):
    # The KV budget holds the cache of a few prompts; the prefix cache may want more.
    eng = make_engine(tiny_model_path, 1 << 30, kv_memory_bytes=4 * 1024 * 1024)
    try:
        for i in range(6):
            request = GenerationRequest(f"b{i}", tokens(1100, seed=400 + i), 2)
            events = support.generate(eng, request)
            assert events.last.error is None
        assert eng.stats().kv_bytes <= 0.85 * 4 * 1024 * 1024
        assert eng.stats().prefix_cache.evictions >= 1
    finally:
        eng.close()


def test_reuse_generated_reuses_any_prefix():
    cache = PrefixCache(1 << 20, CHUNK, reuse_generated=True)
    assert cache._usable(prompt_len=700, held=650) == 650
    assert cache._usable(prompt_len=650, held=650) == 649  # one token is always left to compute
    exact = PrefixCache(1 << 20, CHUNK)
    assert exact._usable(prompt_len=700, held=650) == 512
    assert exact._usable(prompt_len=513, held=650) == 512
    assert exact._usable(prompt_len=512, held=650) == 256


def _two_turns(path, reuse_generated: bool) -> tuple[list[int], list[int], int]:
    prefix = PrefixCacheConfig(max_bytes=1 << 30, reuse_generated=reuse_generated)
    eng = MlxEngine.from_path(str(path), EngineConfig(chunk_size_tokens=CHUNK, prefix_cache=prefix))
    eng.start()
    try:
        first_prompt = SHARED + tokens(50, seed=500)
        first = support.generate(eng, GenerationRequest("t1", first_prompt, 10)).tokens
        second_prompt = first_prompt + tuple(first) + tokens(30, seed=501)
        second = support.generate(eng, GenerationRequest("t2", second_prompt, 10))
        return first, second.tokens, second.events[0].cached_tokens
    finally:
        eng.close()


def test_reuse_generated_reuses_the_reply_and_is_deterministic(tiny_model_path):
    first, second, cached = _two_turns(tiny_model_path, reuse_generated=True)
    # Everything the first turn's sequence held: its prompt and all but its last token.
    assert cached == len(SHARED) + 50 + len(first) - 1
    assert _two_turns(tiny_model_path, reuse_generated=True)[:2] == (first, second)
    exact_first, _, exact_cached = _two_turns(tiny_model_path, reuse_generated=False)
    asked, grid = len(SHARED) + 50, PrefillGrid(CHUNK, 8)  # the probe's rows on this backend
    assert exact_first == first
    assert exact_cached == grid.usable(grid.exact_end(asked), asked + len(first) + 30)
