"""Nodes in network namespaces with shaped links (``mlxcel_plugin.testing.netns``).

Each module builds its own topology and tears it down, nodes first, when its
last test ends, failed or not; a machine without root or iproute2 skips them all
with the reason.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from mlxcel_plugin.testing.netns import NetnsTopology, unavailable_reason
from mlxcel_plugin.testing.netns_nodes import NetnsNodes

GBIT = 1e9

def require_netns() -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)

@contextlib.contextmanager
def netns_cluster(workdir: Path, hosts: Sequence[str],
                  rate_bits_per_s: float | None = GBIT) -> Iterator[NetnsNodes]:
    """A topology of ``hosts`` and a node starter on it; everything gone on exit."""
    require_netns()
    with NetnsTopology(tuple(hosts), rate_bits_per_s=rate_bits_per_s) as net:
        nodes = NetnsNodes(net, workdir)
        try:
            yield nodes
        finally:
            nodes.stop_all()

def fake_model_dir(root: Path, **knobs: int | float) -> str:
    """A model directory for ``--engine fake`` with these ``FakeEngineSettings`` knobs."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "fake_engine.json").write_text(json.dumps(knobs))
    return str(root)
