"""The engine's prefix cache on a Prometheus registry (hybrid, prefill and decode ``/metrics``).

The engine keeps running totals (``EngineStats.prefix_cache``); this collector
reads them at scrape time, so counters stay monotonic without a second copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mlxcel_plugin.engine_api import PrefixCacheStats

PREFIX = "mlxcel:prefix_cache"


class PrefixCacheCollector:
    def __init__(self, read: Callable[[], PrefixCacheStats]):
        self._read = read

    def describe(self) -> list[Metric]:
        return []  # read at collect time only; an engine may start after registration

    def collect(self) -> Iterator[Metric]:
        stats = self._read()
        yield CounterMetricFamily(f"{PREFIX}_hit_tokens", "Prompt tokens served from the "
                                  "prefix cache.", value=stats.hit_tokens)
        yield CounterMetricFamily(f"{PREFIX}_lookup_tokens", "Prompt tokens looked up in the "
                                  "prefix cache.", value=stats.lookup_tokens)
        yield CounterMetricFamily(f"{PREFIX}_evictions", "Prefix cache entries evicted.",
                                  value=stats.evictions)
        yield GaugeMetricFamily(f"{PREFIX}_bytes", "KV bytes held by the prefix cache.",
                                value=stats.cached_bytes)
        yield GaugeMetricFamily(f"{PREFIX}_entries", "Prefixes held by the prefix cache.",
                                value=stats.entries)
        yield GaugeMetricFamily(f"{PREFIX}_exact_min_rows", "Rows a prefill forward needs for "
                                "any cached token to be reused exactly (0: whole chunks only).",
                                value=stats.exact_min_rows)


def register_prefix_cache(registry: CollectorRegistry,
                          read: Callable[[], PrefixCacheStats]) -> None:
    registry.register(PrefixCacheCollector(read))


def prefix_telemetry(stats: PrefixCacheStats) -> tuple[int, int, int, int, int]:
    """The prefix fields of a node's ``Telemetry`` frame: hits, lookups, bytes, evictions,
    and the cache's bound (the router trusts its prefix index only for nodes that have one)."""
    return (stats.hit_tokens, stats.lookup_tokens, stats.cached_bytes, stats.evictions,
            stats.capacity_bytes)
