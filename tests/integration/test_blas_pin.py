"""A real node keeps the OpenBLAS core type its environment pins, and takes an explicit one.

The node re-executes itself with OpenBLAS preloaded (mlxcel_plugin/openblas.py);
what it then runs with is read from the re-executed process itself: its
environment (``/proc/PID/environ``, the same PID after ``execve``) and the
core type OpenBLAS reports inside it (the engine logs it at start-up).

Only the child's environment carries the pin: the test process's own is never
changed. Where the environment already pins a core type, that pin is the one
checked.
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

import pytest

from mlxcel_plugin import openblas
from mlxcel_plugin.local_cluster import NodeProcess, start_node

STARTUP_TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/environ") or openblas.find_openblas() is None
    or platform.machine() != "x86_64" or os.environ.get(openblas.DISABLE_VAR) == "1",
    reason="needs Linux x86_64 with a system OpenBLAS to preload")


def _pin() -> str:
    """The environment's own pin, else a core type every x86_64 with AVX2 runs but auto avoids."""
    return os.environ.get(openblas.CORETYPE_VAR) or "Haswell"


def _other_than(core: str) -> str:
    return "Sandybridge" if core.lower() != "sandybridge" else "Haswell"


def _node(tmp_path, model, env: dict[str, str]) -> tuple[dict[str, str], str, str]:
    node: NodeProcess = start_node("hybrid", tmp_path, ["--model", str(model), "--no-warmup"],
                                   env={"MLXCEL_PROBE_CACHE_DIR": str(tmp_path / "probe"), **env})
    try:
        node.wait_healthy(STARTUP_TIMEOUT_S)
        raw = Path(f"/proc/{node.process.pid}/environ").read_bytes()
    finally:
        node.stop()
    environ = dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
    log = node.log_path.read_text()
    core = re.search(r"BLAS under MLX: \S+ \S+ core (\S+)", log)
    assert core, node.log_tail()
    return environ, core.group(1), log


@pytest.mark.skipif("avx2" not in openblas.read_cpu_flags(), reason="pins Haswell")
def test_a_node_keeps_the_pinned_core_type(tiny_model_path, tmp_path):
    pin = _pin()
    environ, core, log = _node(tmp_path, tiny_model_path, {openblas.CORETYPE_VAR: pin})
    assert "openblas" in environ.get("LD_PRELOAD", "")  # re-executed with OpenBLAS under MLX
    assert environ[openblas.CORETYPE_VAR] == pin
    assert core.lower() == pin.lower()
    if "openblas" not in os.environ.get("LD_PRELOAD", ""):  # else no re-exec, nothing said
        assert f"OPENBLAS_CORETYPE={pin} (as the environment pins it)" in log


@pytest.mark.skipif("avx2" not in openblas.read_cpu_flags(), reason="pins Haswell")
@pytest.mark.skipif(bool(os.environ.get(openblas.CORETYPE_VAR)),
                    reason="the environment pins a core type: no test replaces it")
def test_an_explicit_choice_replaces_the_pin(tiny_model_path, tmp_path):
    pin = _pin()
    chosen = _other_than(pin)
    environ, core, _ = _node(tmp_path, tiny_model_path, {openblas.CORETYPE_VAR: pin,
                                                         openblas.CORETYPE_CHOICE_VAR: chosen})
    assert environ[openblas.CORETYPE_VAR] == chosen
    assert core.lower() == chosen.lower()
