"""Speculative decoding on a Prometheus registry (hybrid and decode ``/metrics``).

Read from the engine's running totals at scrape time, one sample per method.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mlxcel_plugin.speculative.settings import SpeculativeStats

PREFIX = "mlxcel:spec"


class SpeculativeCollector:
    def __init__(self, read: Callable[[], SpeculativeStats]):
        self._read = read

    def describe(self) -> list[Metric]:
        return []  # read at collect time only; an engine may start after registration

    def collect(self) -> Iterator[Metric]:
        methods = self._read().methods
        proposed = CounterMetricFamily(f"{PREFIX}_proposed", "Speculative tokens proposed and "
                                       "verified.", labels=["method"])
        accepted = CounterMetricFamily(f"{PREFIX}_accepted", "Speculative tokens accepted (the "
                                       "target model's own pick).", labels=["method"])
        rate = GaugeMetricFamily(f"{PREFIX}_acceptance_rate", "Accepted over proposed tokens "
                                 "since the engine started.", labels=["method"])
        for method, counts in sorted(methods.items()):
            proposed.add_metric([method], counts.proposed)
            accepted.add_metric([method], counts.accepted)
            rate.add_metric([method], counts.acceptance_rate)
        yield from (proposed, accepted, rate)


def register_speculative(registry: CollectorRegistry,
                         read: Callable[[], SpeculativeStats]) -> None:
    registry.register(SpeculativeCollector(read))
