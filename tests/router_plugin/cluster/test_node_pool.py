from __future__ import annotations

import pytest

from router_plugin.cluster.node_pool import (
    REDACTED,
    NodeHealth,
    NodePool,
    NodeTelemetry,
    stats_verbose_from_env,
)


def make_pool() -> NodePool:
    return NodePool.from_peers(
        ["10.0.0.1:7001", "10.0.0.2:7001"], ["10.0.0.3:7002"], stale_telemetry_s=5.0
    )


def test_ids_are_stable_per_role_and_never_reused():
    pool = make_pool()
    assert pool.ids() == ["prefill-0", "prefill-1", "decode-0"]
    pool.remove("prefill-1")
    assert pool.add("prefill", "10.0.0.9:7001") == "prefill-2"
    assert pool.ids("prefill") == ["prefill-0", "prefill-2"]
    assert pool.find("10.0.0.3:7002") == "decode-0"
    assert pool.find("10.0.0.3:7002", role="prefill") is None


def test_unknown_role_is_refused():
    with pytest.raises(ValueError):
        NodePool().add("router", "x:1")


def test_health_transitions_report_only_real_changes():
    pool = make_pool()
    assert pool.health("prefill-0") is NodeHealth.UNKNOWN
    assert pool.mark_healthy("prefill-0", now=1.0) is True
    assert pool.mark_healthy("prefill-0", now=2.0) is False
    assert pool.mark_unreachable("prefill-0", now=3.0, error="refused") is True
    assert pool.mark_unreachable("prefill-0", now=4.0, error="refused") is False
    assert pool.health("prefill-0") is NodeHealth.UNREACHABLE
    assert pool.mark_healthy("prefill-0", now=5.0) is True


def test_only_healthy_nodes_are_selectable_and_probe_candidates_skip_draining():
    pool = make_pool()
    pool.mark_healthy("prefill-0", now=0.0)
    pool.mark_draining("prefill-1", now=0.0)
    assert [(v.node_id, v.healthy) for v in pool.views("prefill", now=0.0)] == [
        ("prefill-0", True),
        ("prefill-1", False),
    ]
    assert pool.probe_candidates("prefill") == []
    pool.mark_unreachable("prefill-0", now=1.0)
    assert pool.probe_candidates("prefill") == ["prefill-0"]
    assert pool.probe_candidates("decode") == ["decode-0"]  # never probed yet


def test_views_carry_fresh_telemetry_and_reset_stale_reports():
    pool = make_pool()
    pool.mark_healthy("decode-0", now=0.0)
    report = NodeTelemetry(queue_depth=3, active_sequences=7, free_kv_fraction=0.4, tokens_per_s=90)
    pool.update_telemetry("decode-0", report, now=10.0)
    (view,) = pool.views("decode", now=12.0)
    assert (view.queue_depth, view.active_sequences, view.free_kv_fraction) == (3, 7, 0.4)
    assert (view.tokens_per_s, view.telemetry_age_s) == (90, 2.0)
    (stale,) = pool.views("decode", now=15.5)
    assert (stale.queue_depth, stale.free_kv_fraction, stale.telemetry_age_s) == (0, 1.0, None)


def test_unreachable_drops_old_telemetry():
    pool = make_pool()
    pool.update_telemetry("decode-0", NodeTelemetry(queue_depth=9), now=0.0)
    pool.mark_unreachable("decode-0", now=1.0)
    (view,) = pool.views("decode", now=1.0)
    assert (view.healthy, view.queue_depth, view.telemetry_age_s) == (False, 0, None)


def test_in_flight_and_dispatch_counters():
    pool = make_pool()
    for _ in range(3):
        pool.on_dispatch("prefill-1")
    pool.on_finish("prefill-1")
    pool.on_finish("prefill-0")  # never below zero
    pool.on_finish("gone-7")  # a node removed meanwhile: ignored
    views = {v.node_id: v for v in pool.views("prefill", now=0.0)}
    assert (views["prefill-0"].in_flight, views["prefill-1"].in_flight) == (0, 2)
    assert pool.stats(now=0.0)["prefill"][1]["dispatched"] == 3


def test_stats_redact_addresses_and_errors_unless_verbose():
    pool = make_pool()
    pool.mark_healthy("decode-0", now=1.0)
    pool.mark_unreachable("prefill-0", now=2.0, error="connect to 10.0.0.1:7001 refused")
    pool.update_telemetry("decode-0", NodeTelemetry(queue_depth=1), now=3.0)
    stats = pool.stats(now=4.0)
    assert "10.0.0" not in repr(stats)
    assert stats["prefill"][0] == {
        "id": "prefill-0",
        "address": REDACTED,
        "health": "unreachable",
        "health_age_s": 2.0,
        "in_flight": 0,
        "dispatched": 0,
        "consecutive_failures": 1,
        "total_failures": 1,
        "prefix_blocks": 0,
        "telemetry": None,
        "kv": None,  # it announced no profile: it pairs with every decode node
        "pairs": ["decode-0"],
        "refused": [],
        "converts": [],
    }
    assert stats["prefill"][1]["health_age_s"] is None
    assert stats["decode"][0]["telemetry"] == {
        "queue_depth": 1,
        "active_sequences": 0,
        "free_kv_fraction": 1.0,
        "tokens_per_s": 0.0,
        "prefix_hit_tokens": 0,
        "prefix_lookup_tokens": 0,
        "prefix_cached_bytes": 0,
        "prefix_evictions": 0,
        "prefix_capacity_bytes": 0,
        "age_s": 1.0,
    }
    verbose = pool.stats(now=4.0, verbose=True)
    assert verbose["prefill"][0]["address"] == "10.0.0.1:7001"
    assert verbose["prefill"][0]["last_error"] == "connect to 10.0.0.1:7001 refused"


def test_consecutive_failures_reset_on_recovery():
    pool = make_pool()
    pool.mark_unreachable("prefill-0", now=0.0)
    pool.mark_unreachable("prefill-0", now=1.0)
    pool.mark_healthy("prefill-0", now=2.0)
    entry = pool.stats(now=2.0)["prefill"][0]
    assert (entry["consecutive_failures"], entry["total_failures"]) == (0, 2)


@pytest.mark.parametrize(("value", "verbose"), [("1", True), ("0", False), ("", False)])
def test_stats_verbose_env(value, verbose):
    assert stats_verbose_from_env({"MLXCEL_ROUTER_STATS_VERBOSE": value}) is verbose
    assert stats_verbose_from_env({}) is False


# --- membership that changes at runtime (router_plugin/discovery/membership.py) ------


def test_from_peers_leaves_dns_entries_to_the_dns_source():
    pool = NodePool.from_peers(["a:1"], ["dns:decode.svc:9000", "b:2"])
    assert [(pool.role(i), pool.address(i)) for i in pool.ids()] == [("prefill", "a:1"),
                                                                      ("decode", "b:2")]


def test_undrain_serves_a_connected_node_and_reprobes_a_disconnected_one():
    pool = NodePool.from_peers([], ["a:1", "b:2"])
    for node_id in pool.ids():
        pool.mark_draining(node_id, now=1.0)
    assert pool.undrain("decode-0", connected=True, now=2.0)
    assert pool.health("decode-0") is NodeHealth.HEALTHY
    assert pool.undrain("decode-1", connected=False, now=2.0)
    assert "decode-1" in pool.probe_candidates("decode")
    assert not pool.undrain("decode-0", connected=True, now=3.0)  # not draining: no change


def test_in_flight_counts_dispatches_not_yet_finished():
    pool = NodePool.from_peers([], ["a:1"])
    pool.on_dispatch("decode-0")
    pool.on_dispatch("decode-0")
    pool.on_finish("decode-0")
    assert pool.in_flight("decode-0") == 1
