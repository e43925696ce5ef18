"""Received K/V with room: the decode cache writes its next tokens into the handoff's buffers.

Why: mlx-lm's ``KVCache`` grows by concatenating when it is full, so a cache
adopted at exactly its prompt's length copied every received byte (1 GiB at
8k tokens of an 8B model's KV, into fresh pages) at its first decode step.
A decode node's receive buffers are allocated with room past the next step
(``kv_serde.layer_buffers.layer_buffers``, ``ROOM_STEP``); the adopted layer
still shows ``[1, heads, T, dim]`` as ``CacheLayer`` promises, and this
module remembers the whole buffer behind each such view until the engine
rebuilds its cache from it (``kv_convert.from_cache_layer``), which then holds
the buffer itself with ``offset = T``. MLX writes into an array in place only
while no other array shares its memory, so the view is dropped by then and
the first step's token lands in the received buffer.

Process-wide, by object identity: an entry lives as long as its view
(weak reference) and is taken once.
"""

from __future__ import annotations

import threading
import weakref

import mlx.core as mx
from mlx_lm.models.cache import KVCache

ROOM_STEP = KVCache.step  # mlx-lm grows a KVCache this many positions at a time

_held: dict[int, tuple[weakref.ref, mx.array]] = {}
_lock = threading.Lock()  # adopted on the event loop, taken on the engine thread


def remember(view: mx.array, full: mx.array) -> None:
    """``view`` shows the first positions of ``full`` (a buffer with room)."""
    key = id(view)

    def forget(ref: weakref.ref, key: int = key) -> None:
        with _lock:
            if key in _held and _held[key][0] is ref:
                del _held[key]

    with _lock:
        _held[key] = (weakref.ref(view, forget), full)


def take(view: object) -> mx.array | None:
    """The buffer with room behind ``view`` (once), or None."""
    with _lock:
        entry = _held.get(id(view))
        if entry is None or entry[0]() is not view:
            return None
        del _held[id(view)]
    return entry[1]


def held() -> int:
    """Entries not taken yet (for tests)."""
    with _lock:
        return len(_held)
