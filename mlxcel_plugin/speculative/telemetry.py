"""Speculative totals on the way to the router's ``/router/stats``, per node.

A decode node sends its engine's totals (method -> proposed, accepted) in each
TELEMETRY frame (``link/protocol/spec_counts.py``); the router shows them per node
with the acceptance rate.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlxcel_plugin.speculative.settings import SpeculativeStats


def spec_telemetry(stats: SpeculativeStats) -> dict[str, tuple[int, int]]:
    """The TELEMETRY field of an engine's totals ({} before any proposal)."""
    return {method: (counts.proposed, counts.accepted)
            for method, counts in sorted(stats.methods.items())}


def spec_view(counts: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Per method: proposed, accepted and the acceptance rate, as ``/router/stats`` shows."""
    view = {}
    for method, (proposed, accepted) in sorted(counts.items()):
        rate = round(accepted / proposed, 4) if proposed else 0.0
        view[method] = {"proposed": proposed, "accepted": accepted, "acceptance_rate": rate}
    return view
