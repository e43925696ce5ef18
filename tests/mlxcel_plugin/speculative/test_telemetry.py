"""Speculative totals travel in TELEMETRY frames and show per node in ``/router/stats``."""

from __future__ import annotations

import pytest

from mlxcel_plugin.link.protocol.frame_codec import MalformedFrame
from mlxcel_plugin.link.protocol.frames import Telemetry
from mlxcel_plugin.speculative.settings import MethodCounts, SpeculativeStats
from mlxcel_plugin.speculative.telemetry import spec_telemetry
from router_plugin.cluster.node_pool import NodePool, NodeTelemetry
from router_plugin.cluster.stats import RouterStats, snapshot

TOTALS = SpeculativeStats({"ngram": MethodCounts(40, 10, 12), "draft": MethodCounts(8, 6, 2)})


def test_an_engines_totals_round_trip_a_telemetry_frame():
    report = Telemetry("decode-a", "decode", speculative=spec_telemetry(TOTALS))
    assert Telemetry.from_frame(report.to_frame()).speculative == {"draft": (8, 6),
                                                                  "ngram": (40, 10)}
    plain = Telemetry("decode-a", "decode")
    assert "speculative" not in plain.to_frame().header  # absent: what it always sent


@pytest.mark.parametrize("bad", [{"ngram": [3, 4]}, {"ngram": [1]}, {"": [1, 1]},
                                 {"ngram": [-1, 0]}, {"ngram": [True, 0]}, [1, 2],
                                 {f"m{i}": [1, 1] for i in range(9)}])
def test_malformed_totals_are_refused(bad):
    frame = Telemetry("decode-a", "decode").to_frame()
    frame.header["speculative"] = bad
    with pytest.raises(MalformedFrame):
        Telemetry.from_frame(frame)


def test_router_stats_show_each_nodes_totals_and_rate():
    pool = NodePool.from_peers(["10.0.0.1:1"], ["10.0.0.2:1", "10.0.0.3:1"])
    pool.update_telemetry("decode-0", NodeTelemetry(speculative=spec_telemetry(TOTALS)),
                          now=0.0)
    pool.update_telemetry("decode-1", NodeTelemetry(), now=0.0)
    body = snapshot(RouterStats(), pool, queue_depth=0, balancers={}, now=0.1, verbose=False)
    first, second = body["nodes"]["decode"]
    assert first["telemetry"]["speculative"] == {
        "draft": {"proposed": 8, "accepted": 6, "acceptance_rate": 0.75},
        "ngram": {"proposed": 40, "accepted": 10, "acceptance_rate": 0.25}}
    assert "speculative" not in second["telemetry"]  # never speculated: not shown
