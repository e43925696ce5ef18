"""Prefix reuse for caches that cannot be cut back: exact-prefix snapshots at chunk boundaries.

qwen3_next mixes linear-attention layers (``ArraysCache``) with full attention;
mamba2 is SSM state only. A hit must still give a cache-off run's bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

from engines.mlx_engine import MlxEngine
from engines.prefix.cache import PrefixCache
from engines.tiny_models import ensure_arch_model
from mlxcel_plugin.engine_api import (
    EngineConfig,
    GenerationRequest,
    PrefixCacheConfig,
    SamplingParams,
)
from tests.conftest import model_cache_root
from tests.engines import support

CHUNK = 32
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7)


def tokens(n: int, seed: int) -> tuple[int, ...]:
    rng = np.random.default_rng(seed)
    return tuple(int(t) for t in rng.integers(3, 49152, n))


def engine(path, max_bytes: int, reuse_generated: bool = False) -> MlxEngine:
    prefix = PrefixCacheConfig(max_bytes=max_bytes, reuse_generated=reuse_generated)
    eng = MlxEngine.from_path(str(path), EngineConfig(chunk_size_tokens=CHUNK, prefix_cache=prefix))
    eng.start()
    return eng


@pytest.fixture(scope="module", params=["qwen3_next", "mamba2"])
def engines(request):
    path = ensure_arch_model(request.param, root=model_cache_root())
    cached, plain = engine(path, 1 << 30), engine(path, 0)
    yield cached, plain
    cached.close()
    plain.close()


def test_these_models_keep_snapshots_and_tell_routers_not_to_guess(engines):
    assert engines[0]._prefix.snapshots and engines[0]._prefix.enabled
    assert engines[0].stats().prefix_cache.capacity_bytes == 0  # no deltas, no local prefills


@pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_a_conversation_hits_on_later_turns_and_generates_what_cache_off_generates(
        engines, sampling):
    cached, plain = engines
    prompt, previous_len = tokens(100, seed=sampling.seed or 0), 0
    for turn in range(3):
        request = GenerationRequest(f"t{turn}-{sampling.seed}", prompt, 6, sampling)
        hit = support.generate(cached, request)
        off = support.generate(plain, request)
        assert hit.tokens == off.tokens, f"turn {turn}"
        # Turn 1 finds nothing; later turns resume at the previous prompt's last full chunk.
        expected = (previous_len - 1) // CHUNK * CHUNK if turn else 0
        assert hit.events[0].cached_tokens == expected
        previous_len = len(prompt)
        prompt = prompt + tuple(hit.tokens) + tokens(20, seed=turn)


def test_a_snapshot_is_used_only_by_prompts_that_start_with_all_its_tokens(engines):
    cached, _ = engines
    shared = tokens(70, seed=40)
    support.generate(cached, GenerationRequest("s1", shared + tokens(5, seed=41), 2))
    diverging = shared[:50] + tokens(40, seed=42)  # shares 50 tokens: less than the 64 stored
    assert support.generate(cached, GenerationRequest("s2", diverging, 2)).events[0] \
        .cached_tokens == 0


def test_reuse_generated_reuses_the_previous_state_whole(tmp_path):
    path = ensure_arch_model("mamba2", root=model_cache_root())
    eng = engine(path, 1 << 30, reuse_generated=True)
    try:
        first_prompt = tokens(80, seed=50)
        first = support.generate(eng, GenerationRequest("r1", first_prompt, 5)).tokens
        second = first_prompt + tuple(first) + tokens(10, seed=51)
        events = support.generate(eng, GenerationRequest("r2", second, 5))
        # The finished sequence's state: its prompt and all but its last token.
        assert events.events[0].cached_tokens == len(first_prompt) + len(first) - 1
    finally:
        eng.close()


def test_snapshots_are_never_pinned_for_a_delta_handoff():
    cache = PrefixCache(1 << 30, CHUNK, snapshots=True)
    assert not cache.pin("r", tokens(100, seed=60), 64)
