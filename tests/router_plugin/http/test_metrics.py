from prometheus_client import CollectorRegistry, generate_latest

from router_plugin.http.metrics import FrontMetrics, TokenGapHistogram


def test_token_gap_histogram_counts_equal_observations_at_once():
    registry = CollectorRegistry()
    histogram = TokenGapHistogram("gap_seconds", "Gaps.", "m", (0.01, 0.1), registry)
    histogram.observe(0.05)
    histogram.observe(0.0, 3)
    histogram.observe(0.1)  # on a bound: counted in that bucket (le)
    histogram.observe(7.0)
    text = generate_latest(registry).decode()
    assert 'gap_seconds_bucket{le="0.01",model_name="m"} 3.0' in text
    assert 'gap_seconds_bucket{le="0.1",model_name="m"} 5.0' in text
    assert 'gap_seconds_bucket{le="+Inf",model_name="m"} 6.0' in text
    assert 'gap_seconds_count{model_name="m"} 6.0' in text
    assert 'gap_seconds_sum{model_name="m"} 7.15' in text


def test_front_metrics_count_every_token_of_a_burst():
    metrics = FrontMetrics("m")
    metrics.next_tokens(0.02, 4)
    text = metrics.render().decode()
    assert 'mlxcel:inter_token_latency_seconds_count{model_name="m"} 4.0' in text
    assert 'mlxcel:inter_token_latency_seconds_bucket{le="0.001",model_name="m"} 3.0' in text
