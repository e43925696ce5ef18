"""Tests marked ``openblas_child`` run in a child pytest with OpenBLAS mapped under MLX, and
what the child saw (a pass, a failure, a skip) is what the suite reports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel_plugin import openblas
from tests.openblas_child import CHILD_VAR

REPO = Path(__file__).resolve().parents[1]
HAS_OPENBLAS = sys.platform.startswith("linux") and openblas.find_openblas() is not None


@pytest.mark.openblas_child
def test_a_marked_test_runs_in_a_child_with_openblas_mapped():
    if not HAS_OPENBLAS:  # nothing to preload: in process
        assert not os.environ.get(CHILD_VAR)
        return
    assert os.environ.get(CHILD_VAR) == "1"
    assert "libopenblas" in Path("/proc/self/maps").read_text()


CASES = '''
import pytest

@pytest.mark.openblas_child
def test_passes():
    assert True

@pytest.mark.openblas_child
def test_fails():
    assert 1 == 2, "seen in the child"

@pytest.mark.openblas_child
def test_skips():
    pytest.skip("nothing here")
'''


@pytest.mark.skipif(not HAS_OPENBLAS, reason="no OpenBLAS to preload: marked tests run in process")
def test_the_childs_outcome_is_reported(tmp_path: Path):
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_runtest_protocol  # noqa: F401\n")
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    openblas_child: in a child with OpenBLAS\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(CHILD_VAR, None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "-rA", "test_cases.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "1 failed, 1 passed, 1 skipped" in output, output
    assert "seen in the child" in output, output
    assert "in the OpenBLAS child" in output, output
