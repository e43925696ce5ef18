"""Use Debian's OpenBLAS under MLX on Linux: ~25x faster CPU matmuls (docs/design.md).

MLX's CPU wheel links a slow reference BLAS; the only way to swap it is to
preload OpenBLAS before the process starts, so the CLI re-executes itself.
"""

from __future__ import annotations

import glob
import sys
from collections.abc import Mapping

CANDIDATE_GLOBS = (
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
)
DISABLE_VAR = "MLXCEL_NO_OPENBLAS"


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
    current = env.get("LD_PRELOAD", "")
    if library is None or "openblas" in current:
        return None
    new_env = dict(env)
    new_env["LD_PRELOAD"] = f"{library}:{current}" if current else library
    return new_env
