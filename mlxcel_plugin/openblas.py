"""Use an OpenBLAS under MLX on Linux: ~25x faster CPU matmuls (docs/blas.md, docs/design.md).

MLX's CPU wheel links a slow reference BLAS; the only way to swap it is to
preload OpenBLAS before the process starts, so the CLI re-executes itself.

The OpenBLAS environment is the operator's (``OPENBLAS_CORETYPE``,
``OPENBLAS_L2_SIZE``): machines pin them because older OpenBLAS builds
compute wrong results or crash on their processors without them, so by
default a node neither sets, unsets nor overrides either; the re-exec only
adds the preload. ``MLXCEL_OPENBLAS_CORETYPE`` is the explicit opt-in to a
choice of the node's own: ``auto`` asks, on a CPU with AVX-512, for
OpenBLAS's SkylakeX kernels, which give every row of a product of 32+ rows
the same bits (what lets the prefix cache reuse any prefilled token exactly:
engines/prefix/reuse_probe.py, docs/prefix-cache.md); a core type's name
asks for that one; ``keep`` (the default) never chooses.

NumPy brings its own OpenBLAS, which the KV codecs use (int8's Hadamard
rotation is a matmul of 64-value blocks). Its worker threads spin on
``sched_yield`` after every call: on a decode node receiving int8 KV they
burned as much CPU as the decoding itself, beside the link's thread and MLX.
``limit_numpy_blas`` gives NumPy's copy one thread (measured: same wall time
or less, half the CPU) and leaves the OpenBLAS under MLX as it is.
``mlx_blas_threads`` lowers the threads of the BLAS under MLX for one forward
(a speculative verify of a few rows: docs/speculative.md, what a row costs).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

logger = logging.getLogger(__name__)

CANDIDATE_GLOBS = (
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
)
DISABLE_VAR = "MLXCEL_NO_OPENBLAS"
CORETYPE_VAR = "OPENBLAS_CORETYPE"
L2_SIZE_VAR = "OPENBLAS_L2_SIZE"
# Unset or keep: the environment as given; auto, or a core type's name: the opt-in choice.
CORETYPE_CHOICE_VAR = "MLXCEL_OPENBLAS_CORETYPE"
# What OpenBLAS's SkylakeX kernels execute (its own check for that core type).
AVX512_FLAGS = ("avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl")


def find_openblas() -> str | None:
    for pattern in CANDIDATE_GLOBS:
        matches = sorted(glob.glob(pattern))
        if matches:
            return matches[0]
    return None


def preload_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """The environment to re-exec with, or None when no re-exec is needed."""
    if not sys.platform.startswith("linux") or env.get(DISABLE_VAR) == "1":
        return None
    library = find_openblas()
    if library is None:
        return None
    new_env = dict(env)
    current = env.get("LD_PRELOAD", "")
    if "openblas" not in current:
        new_env["LD_PRELOAD"] = f"{library}:{current}" if current else library
    choice = coretype_choice(env)
    coretype = chosen_coretype(choice, read_cpu_flags())
    if coretype is not None:
        new_env[CORETYPE_VAR] = coretype
    if new_env == dict(env):
        return None
    logger.info("OpenBLAS %s preloaded; %s=%s (%s), %s=%s", library, CORETYPE_VAR,
                new_env.get(CORETYPE_VAR, "unset"), _why(env, choice, coretype), L2_SIZE_VAR,
                new_env.get(L2_SIZE_VAR, "unset"))
    return new_env


def _why(env: Mapping[str, str], choice: str, coretype: str | None) -> str:
    if env.get(CORETYPE_CHOICE_VAR):
        return f"{CORETYPE_CHOICE_VAR}={choice}"
    return "as the environment pins it" if env.get(CORETYPE_VAR) else "OpenBLAS detects it"


def coretype_choice(env: Mapping[str, str]) -> str:
    """The explicit choice (``MLXCEL_OPENBLAS_CORETYPE``), else ``keep``: the environment's."""
    return env.get(CORETYPE_CHOICE_VAR, "") or "keep"


def chosen_coretype(choice: str, cpu_flags: set[str]) -> str | None:
    """``OPENBLAS_CORETYPE`` for engine nodes; None: leave it as the environment has it."""
    if choice == "keep":
        return None
    if choice == "auto":
        return "SkylakeX" if has_avx512(cpu_flags) else None
    return choice


def read_cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    try:
        with open(path, encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def has_avx512(flags: set[str]) -> bool:
    return all(flag in flags for flag in AVX512_FLAGS)


def limit_numpy_blas(threads: int = 1) -> int:
    """Cap the BLAS bundled in NumPy's wheel at ``threads``; how many libraries it capped.

    Only libraries under NumPy's own directory are touched (``numpy.libs`` on
    Linux, ``numpy/.dylibs`` on macOS): an OpenBLAS preloaded for MLX is not.
    """
    import numpy
    from threadpoolctl import ThreadpoolController

    numpy_root = os.path.dirname(os.path.dirname(os.path.realpath(numpy.__file__)))
    capped = 0
    for library in ThreadpoolController().select(user_api="blas").lib_controllers:
        path = os.path.realpath(library.filepath or "")
        if _is_numpy_own(path) and path.startswith(numpy_root):
            library.set_num_threads(threads)
            capped += 1
    logger.debug("NumPy's BLAS: %d librar%s capped at %d thread(s)", capped,
                 "y" if capped == 1 else "ies", threads)
    return capped


@functools.cache
def _mlx_blas() -> tuple[Any, ...]:
    """threadpoolctl's controllers of the BLAS libraries here but NumPy's own (found once)."""
    from threadpoolctl import ThreadpoolController

    return tuple(library for library in ThreadpoolController().select(user_api="blas")
                 .lib_controllers if not _is_numpy_own(os.path.realpath(library.filepath or "")))


@contextlib.contextmanager
def mlx_blas_threads(threads: int) -> Iterator[None]:
    """At most ``threads`` threads in the BLAS under MLX inside the block (nothing to do
    where MLX runs its bundled BLAS); each library's own count after it."""
    lowered = [(library, library.num_threads) for library in _mlx_blas()
               if library.num_threads > threads]
    for library, _ in lowered:
        library.set_num_threads(threads)
    try:
        yield
    finally:
        for library, before in lowered:
            library.set_num_threads(before)


def blas_in_process() -> list[dict[str, object]]:
    """The BLAS libraries loaded here but NumPy's own: path, version, core type, threads.

    With OpenBLAS preloaded that is the one under MLX, with the core type it
    really runs (``architecture``, what ``OPENBLAS_CORETYPE`` asked for or what
    it detected); empty when MLX runs its bundled reference BLAS.
    """
    from threadpoolctl import threadpool_info

    found = []
    for library in threadpool_info():
        path = os.path.realpath(library.get("filepath") or "")
        if library.get("user_api") != "blas" or _is_numpy_own(path):
            continue
        found.append({"path": path, "version": library.get("version"),
                      "core": library.get("architecture"),
                      "threads": library.get("num_threads"),
                      "l2_size": os.environ.get(L2_SIZE_VAR, "")})
    return found


def _is_numpy_own(path: str) -> bool:
    return os.path.basename(os.path.dirname(path)) in ("numpy.libs", ".dylibs")
