"""A ``ModelSet``'s loads and evictions on a Prometheus registry, one series per ``model_name``.

Read at scrape time from the set's own counts, so counters stay monotonic
without a second copy (like ``prefix_cache_metrics``).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mlxcel_plugin.scheduling.model_set import ModelSet

PREFIX = "mlxcel:model"
LABELS = ["model_name"]


class ModelSetCollector:
    """The series of ``names`` (each app of a several-model node registers its own model)."""

    def __init__(self, models: ModelSet, names: list[str]):
        self.models, self.names = models, names

    def describe(self) -> list[Metric]:
        return []  # read at collect time only

    def collect(self) -> Iterator[Metric]:
        status = self.models.status()
        counts = {name: self.models.counts[name] for name in self.names}
        loaded = GaugeMetricFamily(f"{PREFIX}_loaded", "Whether the model is loaded (1) or not "
                                   "(0); their sum is the node's loaded models.", labels=LABELS)
        seconds = GaugeMetricFamily(f"{PREFIX}_last_load_seconds", "How long the model's last "
                                    "load took.", labels=LABELS)  # fmt: skip
        families = {field: CounterMetricFamily(f"{PREFIX}_{field}", help_text, labels=LABELS)
                    for field, help_text in _COUNTERS.items()}  # fmt: skip
        for name, count in counts.items():
            loaded.add_metric([name], 1 if status[name] else 0)
            seconds.add_metric([name], count.last_load_s)
            for field, family in families.items():
                family.add_metric([name], getattr(count, field))
        yield loaded
        yield seconds
        yield from families.values()


_COUNTERS = {
    "loads": "Times the model was loaded.",
    "load_failures": "Loads of the model that failed.",
    "evictions": "Times the model was evicted (idle, least recently used) for another.",
    "waits": "Requests for the model that waited for a busy model to go idle.",
    "refusals": "Requests for the model refused (503) after waiting for a busy model.",
}


def register_model_set(registry: CollectorRegistry, models: ModelSet, names: list[str]) -> None:
    registry.register(ModelSetCollector(models, names))
