"""Several models' Prometheus expositions as one: families merged, every sample labelled.

Each model's router app keeps its own registry (``metrics.FrontMetrics``); a scrape
of a several-model router joins them. A family two models both expose appears
once, with each model's samples under it; a sample without a ``model_name``
label (router and membership gauges) gets its model's, as vLLM labels them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

MODEL_LABEL = "model_name"


def _labelled(sample: Sample, model: str) -> Sample:
    if MODEL_LABEL in sample.labels:
        return sample
    return sample._replace(labels={**sample.labels, MODEL_LABEL: model})


class _MergedFamilies:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge_families(expositions: Mapping[str, bytes]) -> list[Metric]:
    """``{model: exposition text}`` -> one family per name, samples of all models."""
    merged: dict[str, Metric] = {}
    for model, text in expositions.items():
        for family in text_string_to_metric_families(text.decode()):
            into = merged.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            into.samples.extend(_labelled(sample, model) for sample in family.samples)
    return list(merged.values())


def merge_expositions(expositions: Mapping[str, bytes]) -> tuple[bytes, str]:
    """The joined exposition and its content type."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_MergedFamilies(merge_families(expositions)))
    return generate_latest(registry), CONTENT_TYPE_LATEST
