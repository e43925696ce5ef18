"""The C library, for the few calls NumPy and MLX do not make for us (malloc_trim, madvise,
prctl)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
import threading


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


PR_SET_NAME = 15  # prctl option: the calling thread's name
_OS_NAME_BYTES = 15  # what Linux keeps of a thread's name
_PREFIX = "mlxcel-"


def name_os_thread(name: str | None = None) -> None:
    """Show the calling thread's Python name (less ``mlxcel-``) to the OS: in
    ``/proc/PID/task/TID/comm``, ``top -H`` and ``perf``. No-op off Linux.

    Why: Python 3.11 leaves every thread named after the process, so neither an
    operator nor a benchmark can tell a node's bulk readers from its event loop.
    """
    libc = linux_libc()
    if libc is None:
        return
    name = name if name is not None else threading.current_thread().name
    name = name.removeprefix(_PREFIX).encode("ascii", "replace")[:_OS_NAME_BYTES]
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
