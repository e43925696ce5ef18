"""The C library, for the few calls NumPy and MLX do not make for us (malloc_trim, madvise)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.cache
def linux_libc() -> ctypes.CDLL | None:
    """glibc with errno kept (``ctypes.get_errno``); None off Linux or where it cannot load.

    Cached: ``find_library`` runs ``ldconfig`` in a subprocess each time it is called.
    """
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None
