"""The decode node's receive pool on ``/metrics`` (docs/bulk-lanes.md#receive-pool): its
bound, and the freed receive buffers it holds faulted in now."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge


def register_receive_pool(registry: CollectorRegistry,
                          pool_bytes: Callable[[], tuple[int, int]]) -> None:
    """Two gauges read live from ``pool_bytes()`` = (bound, held now)."""
    limit = Gauge("mlxcel:receive_pool_limit_bytes",
                  "Freed KV receive buffers kept faulted in, at most (receive_pool_bytes).",
                  registry=registry)
    limit.set_function(lambda: pool_bytes()[0])
    warm = Gauge("mlxcel:receive_pool_warm_bytes",
                 "Freed buffers held faulted in now for the next handoffs.", registry=registry)
    warm.set_function(lambda: pool_bytes()[1])
