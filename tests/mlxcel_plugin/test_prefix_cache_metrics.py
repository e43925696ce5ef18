from prometheus_client import CollectorRegistry, generate_latest

from mlxcel_plugin.engine_api import PrefixCacheStats
from mlxcel_plugin.prefix_cache_metrics import register_prefix_cache


def test_exposes_the_engines_running_totals():
    stats = [PrefixCacheStats()]
    registry = CollectorRegistry()
    register_prefix_cache(registry, lambda: stats[0])
    stats[0] = PrefixCacheStats(hit_tokens=1024, lookup_tokens=1300, cached_bytes=4096,
                                entries=2, evictions=3)
    text = generate_latest(registry).decode()
    assert "mlxcel:prefix_cache_hit_tokens_total 1024.0" in text
    assert "mlxcel:prefix_cache_lookup_tokens_total 1300.0" in text
    assert "mlxcel:prefix_cache_evictions_total 3.0" in text
    assert "mlxcel:prefix_cache_bytes 4096.0" in text
    assert "mlxcel:prefix_cache_entries 2.0" in text
