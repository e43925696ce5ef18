from prometheus_client import CollectorRegistry, generate_latest

from router_plugin.cluster.node_pool import NodePool, NodeTelemetry
from router_plugin.cluster.stats import RouterCollector, RouterStats, snapshot


def test_router_metrics_carry_each_nodes_prefix_cache_report():
    pool = NodePool.from_peers(["10.0.0.1:1"], ["10.0.0.2:1"])
    pool.update_telemetry("prefill-0", NodeTelemetry(prefix_hit_tokens=1024,
                                                     prefix_lookup_tokens=1500,
                                                     prefix_cached_bytes=4096,
                                                     prefix_evictions=2), now=0.0)
    registry = CollectorRegistry()
    registry.register(RouterCollector(RouterStats(), pool, lambda: 0, clock=lambda: 0.5))
    text = generate_latest(registry).decode()
    assert 'mlxcel:router_node_prefix_hit_tokens{node="prefill-0"} 1024.0' in text
    assert 'mlxcel:router_node_prefix_lookup_tokens{node="prefill-0"} 1500.0' in text
    assert 'mlxcel:router_node_prefix_cached_bytes{node="prefill-0"} 4096.0' in text
    assert 'mlxcel:router_node_prefix_evictions{node="prefill-0"} 2.0' in text
    assert 'mlxcel:router_node_prefix_hit_tokens{node="decode-0"} 0.0' in text  # no report yet
    assert 'mlxcel:router_requests_total{outcome="local_prefills"} 0.0' in text


def test_migrations_are_counted_on_metrics_and_stats():
    pool = NodePool.from_peers(["10.0.0.1:1"], ["10.0.0.2:1"])
    stats = RouterStats()
    stats.requests.migrated = 2
    for seconds in (0.2, 0.1):
        stats.observe_migration_resume(seconds)
    registry = CollectorRegistry()
    registry.register(RouterCollector(stats, pool, lambda: 0, clock=lambda: 0.5))
    text = generate_latest(registry).decode()
    assert 'mlxcel:router_requests_total{outcome="migrated"} 2.0' in text
    assert "mlxcel:router_migration_resume_seconds_count 2.0" in text
    assert "mlxcel:router_migration_resume_seconds_sum 0.3" in text
    body = snapshot(stats, pool, queue_depth=0, balancers={}, now=0.5, verbose=False)
    assert body["metrics"]["migrated"] == 2
    assert body["metrics"]["migration_resume_p50_s"] == 0.2
    assert body["metrics"]["migration_resume_p99_s"] == 0.2
    assert snapshot(RouterStats(), pool, queue_depth=0, balancers={}, now=0.5,
                    verbose=False)["metrics"]["migration_resume_p50_s"] is None
