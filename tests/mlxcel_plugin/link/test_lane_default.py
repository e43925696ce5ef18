"""The default lane count follows the cores a node may run on, not the machine's count."""

import os
import subprocess
import sys

import pytest

from mlxcel_plugin.link.config import BULK_LANES_ENV, MAX_DEFAULT_BULK_LANES, default_bulk_lanes

AFFINITY = hasattr(os, "sched_getaffinity")


def lanes_when_pinned_to(cores: set[int]) -> int:
    """default_bulk_lanes() in a fresh process pinned to ``cores`` (no lanes variable)."""
    code = ("import os, sys; from mlxcel_plugin.link.config import default_bulk_lanes; "
            f"os.sched_setaffinity(0, {sorted(cores)!r}); print(default_bulk_lanes())")
    env = {k: v for k, v in os.environ.items() if k != BULK_LANES_ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=60)
    return int(out.stdout)


@pytest.mark.skipif(not AFFINITY, reason="no CPU affinity on this OS")
def test_a_node_pinned_to_one_core_takes_one_lane():
    assert lanes_when_pinned_to({min(os.sched_getaffinity(0))}) == 1


@pytest.mark.skipif(not AFFINITY, reason="no CPU affinity on this OS")
def test_a_node_on_every_core_takes_one_lane_per_core_up_to_the_cap():
    cores = os.sched_getaffinity(0)
    assert lanes_when_pinned_to(cores) == max(1, min(MAX_DEFAULT_BULK_LANES, len(cores)))


def test_the_lanes_variable_still_decides_where_it_is_set():
    assert default_bulk_lanes({BULK_LANES_ENV: "3"}) == 3
