"""Room in MLX's cache of freed buffers for a received cache's buffers, made as they are freed.

Why: MLX keeps a freed buffer only while its cache has room, and never evicts an old
buffer for a new one. A decode node's running streams free buffers of many sizes (their
batch caches are rebuilt as streams join and leave), which keep the cache full; a received
8k-token cache freed into a full cache was dropped, so the next handoff landed in fresh
pages, and handoffs alternated warm and cold (bench_kv_plane's ITL phase: a cold one's
lanes ran at 8-10% of the core and its transfer took 9 s instead of 3, faulting 4 KiB
pages beside the streams' steps). So when an adopted cache with its own large buffers is
finalized, the cache's oldest buffers make room for it first: the newest freed stay.

Why ctypes: ``mx.set_cache_limit`` waits for every CPU stream while holding the GIL, and
a receive buffer being allocated on the event loop (``engines/unfilled.py``: ``mx.load``
reading through a Python object) needs the GIL to finish, so from the engine thread that
could deadlock. MLX's own C++ ``set_cache_limit`` called through ctypes waits with the
GIL released. Where the symbol is not found, nothing is done (buffers are then kept as
MLX alone keeps them).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from engines import engine_memory

log = logging.getLogger(__name__)

# MLX's ``size_t mlx::core::set_cache_limit(size_t)`` (Itanium C++ ABI: Linux and macOS).
_SET_CACHE_LIMIT = "_ZN3mlx4core15set_cache_limitEm"
_LIBRARIES = ("libmlx.so", "libmlx.dylib")
# A layer's K and V from this size on (an 8B model's 8k-token layer: 36 MiB). Room is made
# once per layer cache, and each making waits for every CPU stream: for 2k-token layers
# (9 MiB) on a 10 Gbit/s link that halved the handoff's throughput (bench_kv_plane, two
# runs), where warm pages save least.
MIN_LAYER_BYTES = 32 * 1024 * 1024


@functools.cache
def native_set_cache_limit() -> Callable[[int], int] | None:
    """MLX's C++ ``set_cache_limit`` as a ctypes function (the GIL released), or None."""
    lib_dir = Path(mx.__file__).parent / "lib"
    for name in _LIBRARIES:
        try:
            function = getattr(ctypes.CDLL(str(lib_dir / name)), _SET_CACHE_LIMIT)
        except (OSError, AttributeError):
            continue
        function.restype, function.argtypes = ctypes.c_size_t, [ctypes.c_size_t]
        return function
    log.info("MLX's set_cache_limit not found in %s: received buffers are cached as MLX "
             "alone keeps them", lib_dir)
    return None


def make_room(nbytes: int) -> bool:
    """Free MLX's oldest cached buffers until ``nbytes`` more fit under the cache limit the
    engine applied; whether room was made (False: room enough already, no limit applied,
    or no native setter)."""
    setter = native_set_cache_limit()
    limit = engine_memory.applied_cache_limit()
    if setter is None or limit <= 0 or engine_memory.warm_bytes() + nbytes <= limit:
        return False
    setter(max(limit - nbytes, 0))  # MLX frees its oldest cached buffers down to this
    setter(limit)
    return True


def keep_warm_when_freed(cache: Any, nbytes: int) -> None:
    """When ``cache`` is finalized, make room for the ``nbytes`` of buffers it frees.

    A weakref callback runs before the object's attributes are cleared, so the room is
    made just before its arrays are freed, on the thread that dropped it.
    """
    finalizer = weakref.finalize(cache, make_room, nbytes)
    finalizer.atexit = False  # at exit nothing is kept
