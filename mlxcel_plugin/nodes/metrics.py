"""Prometheus metrics of the prefill and decode nodes (``mlxcel:`` names).

One registry per node object, never the process-global one. Gauges read live
state at scrape time (``set_function``), so nothing has to keep them in step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from mlxcel_plugin.transfer.pacing import RECEIVER_PACED_SHARE

_SECONDS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64,
    1.25, 2.5, 5.0, 10.0, 20.0, 40.0,
)  # fmt: skip
_BYTES = tuple(float(1 << shift) for shift in range(10, 34, 2))


def _gauge(registry: CollectorRegistry, name: str, doc: str, read: Callable[[], float]) -> Gauge:
    gauge = Gauge(name, doc, registry=registry)
    gauge.set_function(read)
    return gauge


class NodeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class PrefillMetrics(NodeMetrics):
    def __init__(self, queue_depth: Callable[[], float], kv_bytes: Callable[[], float]):
        super().__init__()
        r = self.registry
        self.queue_time = Histogram("mlxcel:prefill_queue_time_seconds",
                                    "Time a request waited for a prefill slot.",
                                    buckets=_SECONDS, registry=r)
        self.prefill_time = Histogram("mlxcel:prefill_time_seconds",
                                      "Prefill compute time, first token included.",
                                      buckets=_SECONDS, registry=r)
        self.handoff_bytes = Histogram("mlxcel:handoff_bytes", "Encoded KV bytes per handoff.",
                                       buckets=_BYTES, registry=r)
        self.handoff_time = Histogram("mlxcel:handoff_time_seconds",
                                      "From the first token to the decode node's ack.",
                                      buckets=_SECONDS, registry=r)
        self.handoff_retries = Counter("mlxcel:handoff_retries", "Handoff attempts retried.",
                                       registry=r)
        self.handoff_prefix_missing = Counter(
            "mlxcel:handoff_prefix_missing", "Delta handoffs refused (prefix not held, or a "
            "receiver too old for deltas) and sent again in full.", registry=r)
        self.handoff_chunks_ahead = Counter(
            "mlxcel:handoff_chunks_ahead", "KV chunks sent during prefill, each cell's rows "
            "after its forward (kv_serde/early_rows.py), in acked handoffs.", registry=r)
        self.handoff_rows_stopped = Counter(
            "mlxcel:handoff_rows_stopped", "Acked handoffs whose cells' rows stopped going "
            "ahead: the link fell too far behind prefill (the rest went with its layers).",
            registry=r)
        self.handoff_choices = Counter("mlxcel:handoff_choices",
                                       "Handoffs started, by transfer strategy and codec.",
                                       ["strategy", "codec"], registry=r)
        self.handoff_paced = Counter(
            "mlxcel:handoff_paced", "Acked handoffs by who set their pace: link (a measurement "
            "of its speed), sender or receiver (only a floor on it; docs/bulk-lanes.md).",
            ["by"], registry=r)
        self.handoff_failures = Counter("mlxcel:handoff_failures",
                                        "Handoffs given up, by reason.", ["reason"], registry=r)
        self.requests = Counter("mlxcel:prefill_requests", "Requests by outcome.", ["outcome"],
                                registry=r)
        _gauge(r, "mlxcel:prefill_queue_depth", "Requests waiting for prefill.", queue_depth)
        _gauge(r, "mlxcel:kv_cache_bytes", "KV bytes held (awaiting handoff ack).", kv_bytes)

    def observe_handoff(self, elapsed_s: float, sent_bytes: int, chunks_ahead: int,
                        rows_stopped: bool) -> None:
        """One acked handoff: first token to ack, bytes, and what went ahead of prefill."""
        self.handoff_time.observe(elapsed_s)
        self.handoff_bytes.observe(sent_bytes)
        self.handoff_chunks_ahead.inc(chunks_ahead)
        if rows_stopped:
            self.handoff_rows_stopped.inc()


class DecodeMetrics(NodeMetrics):
    def __init__(self, ingestion_depth: Callable[[], float], batch_size: Callable[[], float],
                 kv_bytes: Callable[[], float], engine_kv_bytes: Callable[[], float]):
        super().__init__()
        r = self.registry
        self.tpot = Histogram("mlxcel:time_per_output_token_seconds",
                              "Time between tokens of one sequence.", buckets=_SECONDS,
                              registry=r)
        self.ingest_time = Histogram("mlxcel:kv_ingest_time_seconds",
                                     "From a handoff's begin to its verified end.",
                                     buckets=_SECONDS, registry=r)
        self.reader_busy = Histogram(
            "mlxcel:kv_ingest_reader_busy_share",
            "Of each handoff's body reading, the share its bulk readers were running or waiting "
            f"for a CPU (>= {RECEIVER_PACED_SHARE}: this node, not the link, set the pace).",
            buckets=(0.2, 0.4, 0.6, 0.8, 0.9, 1.0), registry=r)
        self.handoffs = Counter("mlxcel:kv_handoffs_received", "Handoffs acked ok.", registry=r)
        self.refusals = Counter("mlxcel:kv_handoff_refusals", "Handoffs refused, by code.",
                                ["code"], registry=r)
        self.finished = Counter("mlxcel:decode_requests_finished", "Requests ended, by reason.",
                                ["reason"], registry=r)
        _gauge(r, "mlxcel:decode_ingestion_queue_depth", "Handoffs ingesting or waiting.",
               ingestion_depth)
        _gauge(r, "mlxcel:decode_batch_size", "Sequences in the decode batch.", batch_size)
        _gauge(r, "mlxcel:kv_cache_bytes", "KV bytes reserved by the decode scheduler.", kv_bytes)
        _gauge(r, "mlxcel:engine_kv_cache_bytes", "KV bytes the engine holds.", engine_kv_bytes)


class LoadReport(Protocol):
    """What ``register_inference_extension`` reads (a node's ``Telemetry``)."""

    queue_depth: int
    active_sequences: int
    free_kv_fraction: float


def register_inference_extension(registry: CollectorRegistry,
                                 report: Callable[[], LoadReport]) -> None:
    """The gauges the Gateway API Inference Extension scrapes, under vLLM's names.

    Its model-server protocol asks for the queued requests, the running ones and
    the KV cache in use as a fraction; its endpoint picker looks for vLLM's metric
    names by default.
    """
    _gauge(registry, "vllm:num_requests_waiting", "Requests waiting (Inference Extension).",
           lambda: report().queue_depth)
    _gauge(registry, "vllm:num_requests_running", "Requests running (Inference Extension).",
           lambda: report().active_sequences)
    def kv_used() -> float:
        return min(1.0, max(0.0, 1.0 - report().free_kv_fraction))

    # vLLM renamed its gauge; the extension's releases look for one or the other.
    _gauge(registry, "vllm:gpu_cache_usage_perc",
           "KV cache in use, 0..1 (Inference Extension).", kv_used)
    _gauge(registry, "vllm:kv_cache_usage_perc",
           "KV cache in use, 0..1 (Inference Extension; vLLM's current name).", kv_used)
