"""The OpenBLAS re-exec environment (the preload only: OPENBLAS_* as the environment has them,
unless MLXCEL_OPENBLAS_CORETYPE opts in to a choice), and NumPy's own BLAS capped at one thread.
The nodes' own processes: tests/integration/test_blas_pin.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mlxcel_plugin import openblas

AVX512 = set(openblas.AVX512_FLAGS) | {"sse2", "avx2"}


@pytest.fixture
def with_library(monkeypatch):
    monkeypatch.setattr(openblas.sys, "platform", "linux")
    monkeypatch.setattr(openblas, "find_openblas", lambda: "/usr/lib/libopenblas.so.0")


def test_by_default_only_the_preload_is_added(with_library, monkeypatch):
    monkeypatch.setattr(openblas, "read_cpu_flags", lambda: AVX512)
    assert openblas.preload_env({}) == {"LD_PRELOAD": "/usr/lib/libopenblas.so.0"}
    opted_in = openblas.preload_env({"MLXCEL_OPENBLAS_CORETYPE": "auto"})
    assert opted_in["OPENBLAS_CORETYPE"] == "SkylakeX"  # AVX-512: SkylakeX, when asked


def test_an_environment_that_pins_openblas_keeps_its_pin(with_library, monkeypatch):
    monkeypatch.setattr(openblas, "read_cpu_flags", lambda: AVX512)
    preloaded = {"LD_PRELOAD": "/usr/lib/libopenblas.so.0"}
    for pin in ({"OPENBLAS_CORETYPE": "Haswell"}, {"OPENBLAS_L2_SIZE": "1048576"},
                {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "1048576"}):
        assert openblas.preload_env({**preloaded, **pin}) is None  # nothing to change
        assert openblas.preload_env(pin) == {**preloaded, **pin}  # preloaded, pins as given
    assert openblas.preload_env({**preloaded, "OPENBLAS_CORETYPE": ""}) is None  # kept empty


def test_an_explicit_choice_replaces_the_pin(with_library, monkeypatch):
    monkeypatch.setattr(openblas, "read_cpu_flags", lambda: AVX512)
    pinned = {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "1048576",
              "LD_PRELOAD": "/usr/lib/libopenblas.so.0"}
    chosen = openblas.preload_env({**pinned, "MLXCEL_OPENBLAS_CORETYPE": "auto"})
    assert chosen["OPENBLAS_CORETYPE"] == "SkylakeX"
    assert chosen["OPENBLAS_L2_SIZE"] == "1048576"  # only the core type is chosen
    chosen = openblas.preload_env({**pinned, "MLXCEL_OPENBLAS_CORETYPE": "Zen"})
    assert chosen["OPENBLAS_CORETYPE"] == "Zen"
    assert openblas.preload_env({**pinned, "MLXCEL_OPENBLAS_CORETYPE": "keep"}) is None
    kept = openblas.preload_env({"MLXCEL_OPENBLAS_CORETYPE": "keep"})
    assert "OPENBLAS_CORETYPE" not in kept  # keep: never chosen, even with no pin
    done = {**pinned, "OPENBLAS_CORETYPE": "SkylakeX", "MLXCEL_OPENBLAS_CORETYPE": "auto"}
    assert openblas.preload_env(done) is None  # already as wanted: no re-exec
    assert openblas.preload_env({"MLXCEL_NO_OPENBLAS": "1"}) is None


def test_machines_without_avx512_keep_their_kernels(with_library, monkeypatch):
    monkeypatch.setattr(openblas, "read_cpu_flags", lambda: {"sse2", "avx2", "avx512f"})
    assert "OPENBLAS_CORETYPE" not in openblas.preload_env({"MLXCEL_OPENBLAS_CORETYPE": "auto"})


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx2\n")
    assert openblas.read_cpu_flags(str(cpuinfo)) == {"fpu", "avx512f", "avx2"}
    assert openblas.read_cpu_flags(str(tmp_path / "missing")) == set()


NUMPY_BLAS_PROBE = """
import json, sys
import numpy
from threadpoolctl import threadpool_info
before = {i["filepath"]: i["num_threads"] for i in threadpool_info()}
from mlxcel_plugin import openblas
capped = openblas.limit_numpy_blas()
after = {i["filepath"]: i["num_threads"] for i in threadpool_info()}
print(json.dumps({"capped": capped, "before": before, "after": after}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="NumPy's Linux wheel bundles OpenBLAS")
def test_numpy_blas_gets_one_thread_and_a_preloaded_openblas_keeps_its_own():
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "2"}
    library = openblas.find_openblas()
    if library is not None:
        env["LD_PRELOAD"] = library
    done = subprocess.run([sys.executable, "-c", NUMPY_BLAS_PROBE], env=env, check=True,
                          capture_output=True, text=True, timeout=120)
    found = json.loads(done.stdout)
    numpy_libs = [path for path in found["after"] if "numpy" in path]
    assert found["capped"] == len(numpy_libs) == 1
    assert found["after"][numpy_libs[0]] == 1
    for path, threads in found["after"].items():
        if path not in numpy_libs:  # the OpenBLAS under MLX: untouched
            assert threads == found["before"][path] == 2
    if library is not None:
        assert len(found["after"]) == 2


MLX_BLAS_THREADS_PROBE = """
import json
from threadpoolctl import threadpool_info
from mlxcel_plugin import openblas
def counts():
    return {i["filepath"]: i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}
before = counts()
with openblas.mlx_blas_threads(1):
    inside = counts()
print(json.dumps({"before": before, "inside": inside, "after": counts()}))
"""


@pytest.mark.skipif(openblas.find_openblas() is None, reason="no OpenBLAS to preload here")
def test_the_blas_under_mlx_runs_one_thread_inside_the_block_and_its_own_after():
    library = openblas.find_openblas()
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "2", "LD_PRELOAD": library}
    done = subprocess.run([sys.executable, "-c", MLX_BLAS_THREADS_PROBE], env=env, check=True,
                          capture_output=True, text=True, timeout=120)
    found = json.loads(done.stdout)
    mlx_blas = [path for path in found["before"] if "numpy" not in path]
    assert mlx_blas and all(found["before"][path] == 2 for path in mlx_blas)
    assert all(found["inside"][path] == 1 for path in mlx_blas)
    assert found["after"] == found["before"]  # NumPy's own untouched throughout
