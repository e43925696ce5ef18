"""Prefix-cache entries keyed by adapter: a base entry never serves an adapter's lookup."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from engines.prefix.cache import PrefixCache

TOKENS = tuple(range(3, 3 + 64))


def filled(n: int) -> list[KVCache]:
    cache = KVCache()
    cache.update_and_fetch(mx.ones((1, 2, n, 8)), mx.ones((1, 2, n, 8)))
    return [cache]


def test_keyed_views_keep_entries_apart_and_share_the_budget():
    base = PrefixCache(1 << 20, 16)
    sql = base.keyed(("sql", "d1"))
    assert base.keyed(("sql", "d1")) is sql  # one view per key
    base.store_prompt(TOKENS, filled(len(TOKENS)))
    assert sql.lookup(TOKENS + (9,)).reused_tokens == 0  # the base's K/V: not the adapter's
    assert base.keyed(("sql", "other digest")).lookup(TOKENS + (9,)).reused_tokens == 0
    sql.store_prompt(TOKENS, filled(len(TOKENS)))
    reused = sql.lookup(TOKENS + (9,)).reused_tokens
    assert reused > 0 and base.lookup(TOKENS + (9,)).reused_tokens == reused
    stats = base.stats()  # the views' hits and lookups count in the one cache's stats
    assert stats.entries == 2 and stats.cached_bytes == base.nbytes == sql.nbytes
    assert stats.hit_tokens == 2 * reused
    assert stats.lookup_tokens == 4 * (len(TOKENS) + 1)
    base.evict_to(0)  # one LRU for both: the base's eviction empties the adapter's too
    assert sql.lookup(TOKENS + (9,)).reused_tokens == 0
