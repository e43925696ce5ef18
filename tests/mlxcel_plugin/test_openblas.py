"""The OpenBLAS re-exec environment: preload, and SkylakeX kernels where AVX-512 runs them."""

from __future__ import annotations

import pytest

from mlxcel_plugin import openblas

AVX512 = set(openblas.AVX512_FLAGS) | {"sse2", "avx2"}


@pytest.fixture
def with_library(monkeypatch):
    monkeypatch.setattr(openblas.sys, "platform", "linux")
    monkeypatch.setattr(openblas, "find_openblas", lambda: "/usr/lib/libopenblas.so.0")


def test_avx512_machines_get_the_skylakex_kernels(with_library, monkeypatch):
    monkeypatch.setattr(openblas, "read_cpu_flags", lambda: AVX512)
    env = openblas.preload_env({})
    assert env["LD_PRELOAD"] == "/usr/lib/libopenblas.so.0"
    assert env["OPENBLAS_CORETYPE"] == "SkylakeX"


def test_a_pinned_haswell_is_replaced_unless_asked_to_keep_it(with_library, monkeypatch):
    monkeypatch.setattr(openblas, "read_cpu_flags", lambda: AVX512)
    pinned = {"OPENBLAS_CORETYPE": "Haswell", "LD_PRELOAD": "/usr/lib/libopenblas.so.0"}
    assert openblas.preload_env(pinned)["OPENBLAS_CORETYPE"] == "SkylakeX"
    assert openblas.preload_env({**pinned, "MLXCEL_OPENBLAS_CORETYPE": "keep"}) is None
    chosen = openblas.preload_env({**pinned, "MLXCEL_OPENBLAS_CORETYPE": "Zen"})
    assert chosen["OPENBLAS_CORETYPE"] == "Zen"
    done = {**pinned, "OPENBLAS_CORETYPE": "SkylakeX"}
    assert openblas.preload_env(done) is None  # already as wanted: no re-exec
    assert openblas.preload_env({"MLXCEL_NO_OPENBLAS": "1"}) is None


def test_machines_without_avx512_keep_their_kernels(with_library, monkeypatch):
    monkeypatch.setattr(openblas, "read_cpu_flags", lambda: {"sse2", "avx2", "avx512f"})
    assert "OPENBLAS_CORETYPE" not in openblas.preload_env({})


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx2\n")
    assert openblas.read_cpu_flags(str(cpuinfo)) == {"fpu", "avx512f", "avx2"}
    assert openblas.read_cpu_flags(str(tmp_path / "missing")) == set()
