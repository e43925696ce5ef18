"""Run a test marked ``openblas_child`` in a child pytest with OpenBLAS preloaded under MLX.

A test process cannot swap MLX's BLAS once it has started (mlxcel_plugin/openblas.py), and
the suite's own processes keep MLX's reference BLAS: several tiny-model exactness tests
compare bits that OpenBLAS computes otherwise. In-process tests of the real SmolLM2 spend
~4x their time in that reference BLAS (the speculation test 19.6 -> 4.6 s), so they run in a
child pytest started as a node is, with the preload added and the environment otherwise
as given (no ``OPENBLAS_*`` variable set or changed). Without an OpenBLAS to preload (macOS,
or none installed) they run in process as any other test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel_plugin import openblas

MARKER = "openblas_child"
CHILD_VAR = "MLXCEL_TEST_OPENBLAS_CHILD"  # set in the child: its tests run in process
DEFAULT_TIMEOUT_S = 900.0


def child_env(item: pytest.Item) -> dict[str, str] | None:
    """The child's environment, or None where ``item`` runs in this process."""
    if item.get_closest_marker(MARKER) is None or os.environ.get(CHILD_VAR):
        return None
    env = openblas.preload_env(os.environ)
    return None if env is None else {**env, CHILD_VAR: "1"}


def run_protocol(item: pytest.Item, env: dict[str, str]) -> None:
    """``item``'s setup, call and teardown reports, its call being the child's run (no fixture
    of ``item`` is set up here: the child sets up its own)."""
    hook = item.ihook
    hook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for when in ("setup", "call", "teardown"):
        action = (lambda: run_in_child(item, env)) if when == "call" else (lambda: None)
        call = pytest.CallInfo.from_call(action, when=when)
        hook.pytest_runtest_logreport(report=hook.pytest_runtest_makereport(item=item, call=call))
    hook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)


def run_in_child(item: pytest.Item, env: dict[str, str]) -> None:
    marker = item.get_closest_marker("timeout")
    timeout_s = float(marker.args[0]) if marker and marker.args else DEFAULT_TIMEOUT_S
    root = Path(item.config.rootpath)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
               "-rs", item.nodeid]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    output = done.stdout + done.stderr
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    if done.returncode == 0 and " passed" in summary:
        return
    if done.returncode == 0 and " skipped" in summary:
        pytest.skip(f"in the OpenBLAS child: {summary}")
    pytest.fail(f"in the OpenBLAS child (exit {done.returncode}):\n{output[-6000:]}",
                pytrace=False)
