"""Prometheus metrics of the HTTP front (vLLM-style names, ``mlxcel:`` prefix).

One registry per app, never the process-global one: several apps (tests, a
router and a hybrid in one process) must not collide.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class TokenGapHistogram:
    """A histogram fed on the event loop, several equal observations at a time.

    Tokens relayed in one burst share one arrival time: the first carries the
    gap, the rest a gap of 0. ``prometheus_client``'s Histogram takes one
    observation per call under a lock, which the relay would pay per token.
    """

    def __init__(self, name: str, documentation: str, model_name: str,
                 buckets: Sequence[float], registry: CollectorRegistry):
        self._name, self._doc, self._model = name, documentation, model_name
        self._bounds = tuple(buckets)
        self._counts = [0] * (len(self._bounds) + 1)  # the last one is +Inf
        self._sum = 0.0
        registry.register(self)

    def observe(self, seconds: float, times: int = 1) -> None:
        self._counts[bisect_left(self._bounds, seconds)] += times  # bucket: value <= bound
        self._sum += seconds * times

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._doc, labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, count in zip((*self._bounds, float("inf")), self._counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric([self._model], buckets, self._sum)
        yield family


class FrontMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self._ttft = Histogram(
            "mlxcel:time_to_first_token_seconds", "Time to first token.", labels,
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self._itl = TokenGapHistogram(
            "mlxcel:inter_token_latency_seconds", "Time between generated tokens.", model_name,
            _LATENCY_BUCKETS_S, r,
        )  # fmt: skip
        self._e2e = Histogram(
            "mlxcel:e2e_request_latency_seconds", "End-to-end request latency.", labels,
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self._prompt = Counter(
            "mlxcel:prompt_tokens", "Prompt tokens processed.", labels, registry=r
        )
        self._cached = Counter(
            "mlxcel:prompt_cached_tokens", "Prompt tokens served from a node's prefix cache.",
            labels, registry=r,
        )  # fmt: skip
        self._generation = Counter(
            "mlxcel:generation_tokens", "Tokens generated.", labels, registry=r
        )
        self._success = Counter(
            "mlxcel:request_success", "Finished requests.", labels + ["finished_reason"],
            registry=r,
        )  # fmt: skip
        self._errors = Counter(
            "mlxcel:request_errors", "Requests that failed.", labels + ["code", "status"],
            registry=r,
        )
        self._api = Counter(
            "mlxcel:api_requests", "Requests received, per API (chat_completions, completions, "
            "responses, messages, count_tokens).", labels + ["api"], registry=r,
        )  # fmt: skip
        self._running = Gauge(
            "mlxcel:num_requests_running", "Requests being generated.", labels, registry=r
        )
        self._model = model_name
        # Children of the per-model series, looked up once: next_token runs per token.
        self._ttft_m = self._ttft.labels(model_name)
        self._running_m = self._running.labels(model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def api_request(self, api: str) -> None:
        self._api.labels(self._model, api).inc()

    def cached_prompt_tokens(self, tokens: int) -> None:
        self._cached.labels(self._model).inc(tokens)

    def request_started(self, prompt_tokens: int) -> None:
        self._prompt.labels(self._model).inc(prompt_tokens)
        self._running_m.inc()

    def request_ended(self) -> None:
        self._running_m.dec()

    def first_token(self, seconds: float) -> None:
        self._ttft_m.observe(seconds)

    def next_tokens(self, gap_s: float, count: int) -> None:
        """``count`` tokens arrived together, ``gap_s`` after the previous one."""
        self._itl.observe(gap_s)
        if count > 1:
            self._itl.observe(0.0, count - 1)

    def finished(self, reason: str, generated_tokens: int, e2e_s: float) -> None:
        self._generation.labels(self._model).inc(generated_tokens)
        self._success.labels(self._model, reason).inc()
        self._e2e.labels(self._model).observe(e2e_s)

    def failed(self, code: str, status: int | None = None) -> None:
        """A refused or failed request; without ``status``, one that ended after it started."""
        if status is None:
            status = 499 if code == "cancelled" else 500  # 499: the client went away
        self._errors.labels(self._model, code, str(status)).inc()
