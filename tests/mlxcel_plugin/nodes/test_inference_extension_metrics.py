"""The Gateway API Inference Extension's gauges, read from a node's load report."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest

from mlxcel_plugin.nodes.metrics import register_inference_extension


@dataclass
class Report:
    queue_depth: int = 0
    active_sequences: int = 0
    free_kv_fraction: float = 1.0


def scrape(report: Report) -> dict[str, float]:
    registry = CollectorRegistry()
    register_inference_extension(registry, lambda: report)
    values = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.split()
            values[name] = float(value)
    return values


def test_waiting_running_and_kv_usage_fraction_under_vllm_names():
    assert scrape(Report(queue_depth=3, active_sequences=2, free_kv_fraction=0.25)) == {
        "vllm:num_requests_waiting": 3.0,
        "vllm:num_requests_running": 2.0,
        "vllm:gpu_cache_usage_perc": 0.75,
        "vllm:kv_cache_usage_perc": 0.75,  # vLLM's current name, beside the old one
    }


def test_kv_usage_is_read_at_scrape_time_and_clamped():
    report = Report(free_kv_fraction=1.0)
    registry = CollectorRegistry()
    register_inference_extension(registry, lambda: report)
    assert registry.get_sample_value("vllm:gpu_cache_usage_perc") == 0.0
    report.free_kv_fraction = -0.5  # an over-committed budget still reads as full
    assert registry.get_sample_value("vllm:gpu_cache_usage_perc") == 1.0
    assert registry.get_sample_value("vllm:kv_cache_usage_perc") == 1.0
