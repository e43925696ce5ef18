"""What ``GET /router/stats`` shows: per-node counts and health, and request totals.

Node entries come from the ``NodePool`` (stable ids like ``prefill-0``;
addresses redacted unless ``MLXCEL_ROUTER_STATS_VERBOSE=1``); a node that
speculates shows its totals per method with the acceptance rate. The counters
here are the router's own; the cluster backend bumps them, the route reads a
snapshot. The same numbers go to ``/metrics`` through ``RouterCollector``.
"""

from __future__ import annotations

import os
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from mlxcel_plugin.speculative.telemetry import spec_view
from router_plugin.cluster.node_pool import NodeHealth, NodePool, stats_verbose_from_env

MIGRATION_SAMPLES = 1024  # resume times kept for /router/stats' quantiles


@dataclass
class RequestCounters:
    total: int = 0  # admitted to placement (past admission)
    completed: int = 0  # ended with a finish reason other than error/cancel
    failed: int = 0  # ended with an error event, or could not be placed
    closed_early: int = 0  # the front ended it first: client gone, stop string
    rerouted: int = 0  # placement attempts after the first
    migrated: int = 0  # moves to a new pair after the client saw tokens
    local_prefills: int = 0  # placed on a decode node alone: it held most of the prompt
    rejected: int = 0  # refused with 503 (admission, no healthy node, queue timeout)
    queued: int = 0  # ever waited in the admission queue


@dataclass
class RouterStats:
    """Counters and gauges the cluster backend keeps up to date."""

    requests: RequestCounters = field(default_factory=RequestCounters)
    active_prefills: int = 0  # placed, first token not yet seen
    active_decodes: int = 0  # first token seen, stream not yet ended
    # Seconds from a migration's start to its first continued token (the latest ones).
    migration_resume_s: deque[float] = field(
        default_factory=lambda: deque(maxlen=MIGRATION_SAMPLES))
    migration_resume_total_s: float = 0.0  # over every migration, for /metrics
    migration_resumes: int = 0
    # Handoffs a decode node refused (the request went to another pair), by refusal code.
    refused_handoffs: Counter[str] = field(default_factory=Counter)

    def count_refused_handoff(self, code: str) -> None:
        self.refused_handoffs[code] += 1

    def observe_migration_resume(self, seconds: float) -> None:
        self.migration_resume_s.append(seconds)
        self.migration_resume_total_s += seconds
        self.migration_resumes += 1


def snapshot(stats: RouterStats, pool: NodePool, *, queue_depth: int,
             balancers: Mapping[str, str], now: float, verbose: bool) -> dict[str, Any]:
    """The JSON body of ``GET /router/stats``."""
    return {
        "nodes": with_speculation(pool.stats(now, verbose=verbose)),
        "balancers": dict(balancers),
        "metrics": {
            **asdict(stats.requests),
            "queue_depth": queue_depth,
            "active_prefills": stats.active_prefills,
            "active_decodes": stats.active_decodes,
            **migration_resume_quantiles(stats.migration_resume_s),
            "refused_handoffs": dict(stats.refused_handoffs),
            "pair_refusals": dict(pool.pairing.reason_counts),
        },
    }


def with_speculation(nodes: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Each node's speculative totals (from its telemetry) with their acceptance rate."""
    for entries in nodes.values():
        for entry in entries:
            telemetry = entry.get("telemetry") or {}
            if "speculative" in telemetry:
                telemetry["speculative"] = spec_view(telemetry["speculative"])
    return nodes


def migration_resume_quantiles(samples: Collection[float]) -> dict[str, float | None]:
    """p50/p99 of the latest migrations' resume times (None before the first)."""
    ordered = sorted(samples)
    if not ordered:
        return {"migration_resume_p50_s": None, "migration_resume_p99_s": None}
    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)
    return {"migration_resume_p50_s": at(0.5), "migration_resume_p99_s": at(0.99)}


def make_stats_route(stats: RouterStats, pool: NodePool, queue_depth: Callable[[], int],
                     balancers: Mapping[str, str], *, env: Mapping[str, str] | None = None,
                     clock: Callable[[], float] = time.monotonic) -> Callable[[], dict]:
    """The handler; verbosity is read once, at startup, like every other setting."""
    verbose = stats_verbose_from_env(os.environ if env is None else env)

    def router_stats() -> dict[str, Any]:
        return snapshot(stats, pool, queue_depth=queue_depth(), balancers=balancers,
                        now=clock(), verbose=verbose)

    return router_stats


class RouterCollector(Collector):
    """The router's counters as Prometheus metrics (node ids only, never addresses)."""

    def __init__(self, stats: RouterStats, pool: NodePool, queue_depth: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic):
        self._stats, self._pool, self._queue_depth, self._clock = stats, pool, queue_depth, clock

    def collect(self) -> Iterator[Any]:
        requests = CounterMetricFamily("mlxcel:router_requests", "Router requests by outcome.",
                                       labels=["outcome"])
        for outcome, value in asdict(self._stats.requests).items():
            requests.add_metric([outcome], value)
        yield requests
        yield SummaryMetricFamily(
            "mlxcel:router_migration_resume_seconds",
            "From a mid-stream migration's start to its first continued token.",
            count_value=self._stats.migration_resumes,
            sum_value=self._stats.migration_resume_total_s)
        yield from self._refusals()
        yield from self._gauges()
        yield from self._nodes()

    def _refusals(self) -> Iterator[Any]:
        pairs = CounterMetricFamily(
            "mlxcel:router_pair_refusals", "Node pairs (or nodes) refused before any traffic, "
            "by reason: the decode node cannot take the KV, or tokenizer/template differ.",
            labels=["reason"])
        for reason, value in self._pool.pairing.reason_counts.items():
            pairs.add_metric([reason], value)
        yield pairs
        handoffs = CounterMetricFamily(
            "mlxcel:router_refused_handoffs", "Handoffs a decode node refused; each request "
            "went on on another pair (outcome rerouted), by refusal code.", labels=["code"])
        for code, value in self._stats.refused_handoffs.items():
            handoffs.add_metric([code], value)
        yield handoffs

    def _gauges(self) -> Iterator[Any]:
        values = {
            "queue_depth": ("Requests waiting in the admission queue.", self._queue_depth()),
            "active_prefills": ("Requests waiting for their first token.",
                                self._stats.active_prefills),
            "active_decodes": ("Requests streaming decode tokens.", self._stats.active_decodes),
        }
        for name, (doc, value) in values.items():
            yield GaugeMetricFamily(f"mlxcel:router_{name}", doc, value=value)

    def _nodes(self) -> Iterator[Any]:
        dispatched = CounterMetricFamily("mlxcel:router_node_dispatched",
                                         "Requests dispatched per node.", labels=["node"])
        healthy = GaugeMetricFamily("mlxcel:router_node_healthy", "1 when the node is healthy.",
                                    labels=["node"])
        prefix = {name: GaugeMetricFamily(f"mlxcel:router_node_{name}", doc, labels=["node"])
                  for name, doc in _NODE_PREFIX_GAUGES.items()}
        for entries in self._pool.stats(self._clock()).values():
            for entry in entries:
                dispatched.add_metric([entry["id"]], entry["dispatched"])
                healthy.add_metric([entry["id"]], float(entry["health"] == NodeHealth.HEALTHY))
                telemetry = entry["telemetry"] or {}
                for name, family in prefix.items():
                    family.add_metric([entry["id"]], telemetry.get(name, 0))
        yield dispatched
        yield healthy
        yield from prefix.values()


# A node's prefix cache as its last telemetry reported it (running totals, or bytes now).
_NODE_PREFIX_GAUGES = {
    "prefix_hit_tokens": "Prompt tokens the node served from its prefix cache (its total).",
    "prefix_lookup_tokens": "Prompt tokens the node looked up in its prefix cache (its total).",
    "prefix_cached_bytes": "KV bytes held by the node's prefix cache.",
    "prefix_evictions": "Prefix cache entries the node evicted (its total).",
}
