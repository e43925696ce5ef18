"""mlx-lm per-sequence leaf caches <-> ``CacheLayer`` (numpy, sliced to the live tokens).

Which arrays each cache kind travels as is ``engines/cache_layout.py``'s;
a kind it does not know is refused with ``HandoffError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from engines import cache_admission, cache_layout, engine_memory, kv_room
from engines.cache_layout import HANDOFF_KINDS, dtype_name
from engines.unfilled import (
    PREFAULT_AHEAD_BYTES,
    PREFAULT_STEP_BYTES,
    SlabCarver,
    mlx_room_view,
    mlx_view,
)
from mlxcel_plugin.engine_api import CacheLayer, CacheState, RowsReady
from mlxcel_plugin.errors import CacheNotTransferableError, HandoffError
from mlxcel_plugin.kv_serde.header import ModelFingerprint

SUPPORTED_KINDS = HANDOFF_KINDS
__all__ = ["SUPPORTED_KINDS", "dtype_name"]

# numpy has no bfloat16: it travels as the raw uint16 bit pattern.
_VIEW_AS = {mx.bfloat16: mx.uint16}
_MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# numpy storage dtype of received K/V -> MLX dtype of the same bytes.
_MX_STORAGE = {np.dtype(np.float32): mx.float32, np.dtype(np.float16): mx.float16,
               np.dtype(np.uint16): mx.uint16, np.dtype(np.uint32): mx.uint32}


def check_cache_kinds(caches: list[Any]) -> None:
    """Raise ``CacheNotTransferableError`` (HTTP 501) unless every leaf cache can be exported."""
    unsupported = cache_layout.unsupported_kinds(caches)
    if unsupported:
        raise CacheNotTransferableError(
            f"cache classes {unsupported} cannot be handed off "
            f"(supported: {', '.join(SUPPORTED_KINDS)}): this model runs on hybrid nodes only"
        )


def _to_numpy(x: mx.array) -> np.ndarray:
    """A numpy copy of ``x`` (bf16 as its uint16 bits)."""
    view = _VIEW_AS.get(x.dtype)
    return np.array(x.view(view) if view is not None else x)


def _numpy_view(x: mx.array) -> np.ndarray:
    """``x``'s own memory as numpy (evaluating it; strided where ``x`` is a slice), no copy.

    Safe to read while the engine goes on: the view holds the MLX array, and
    MLX never writes a buffer another array still refers to (an in-place update
    of the cache copies it first), so these bytes stay what prefill computed.
    """
    view = _VIEW_AS.get(x.dtype)
    array = np.array(x.view(view) if view is not None else x, copy=False)
    array.flags.writeable = False  # MLX's memory: nothing on this side may write it
    return array


def cells_to_rows(on_rows: RowsReady) -> Callable[[int, int, list[Any]], None]:
    """A ``run_prefill`` cell hook handing each layer's new rows to ``on_rows`` as numpy
    copies (the cache's buffer is written on); none where a cache is not a plain KVCache
    (its layers go whole)."""
    def cell_done(first: int, end: int, caches: list[Any]) -> None:
        if not all(type(cache) is KVCache for cache in caches):
            return
        for index, cache in enumerate(caches):
            on_rows(index, first, {"k": _to_numpy(cache.keys[..., first:end, :]),
                                   "v": _to_numpy(cache.values[..., first:end, :])})
    return cell_done


def live_keys_values(cache: Any) -> tuple[mx.array, mx.array]:
    """The cached K/V without the unused tail of the buffer (temporal order for rotating)."""
    arrays = cache_layout.live_arrays(cache)
    return arrays["k"], arrays["v"]


def to_cache_layer(cache: Any, prompt_len: int | None = None) -> CacheLayer:
    """One evaluated leaf cache as numpy views of its MLX memory, not copies (the KV
    writer sends a strided view head by head); ``prompt_len``: a fixed-size state's offset."""
    arrays = cache_layout.live_arrays(cache)
    offset = getattr(cache, "offset", None)
    offset = int(offset) if isinstance(offset, int) else int(prompt_len or 1)
    if not arrays:
        raise HandoffError(f"a {type(cache).__name__} holds no state yet")
    held = arrays["k"].shape[2] if "k" in arrays else 0
    first = next(iter(arrays.values()))
    floats = [a.dtype for a in arrays.values() if mx.issubdtype(a.dtype, mx.floating)]
    return CacheLayer.of_arrays(
        type(cache).__name__,
        {name: _numpy_view(a) for name, a in arrays.items()},
        dtype_name(floats[0] if floats else first.dtype),
        offset,
        cache_layout.layer_meta(cache, held),
    )


def kv_buffers(
    shape: tuple[int, ...], dtype: np.dtype, count: int, carver: SlabCarver
) -> list[np.ndarray]:
    """Fresh MLX arrays' memory as writable numpy views (what ``adopt_layer`` takes back).

    Why: received K/V decrypted straight into MLX memory skips the copy into
    MLX per layer (256 MiB: ~30 ms copying), and the arrays are neither
    filled first nor allocated one by one (``unfilled``). The carver's stream
    must not be the engine's: an allocation there would wait for the running
    decode step.
    """
    storage = _MX_STORAGE.get(np.dtype(dtype))
    if storage is None:
        raise HandoffError(f"unsupported KV storage dtype {np.dtype(dtype)}")
    return carver.buffers(shape, np.dtype(dtype), storage, count)


class ReceiveBuffers:
    """An engine's ``kv_buffers`` (engine_api.Engine): ``kv_buffers`` below with a carver of
    its own, made on first use; plain K/V get room for ``kv_room_step`` more positions."""

    kv_room_step = kv_room.ROOM_STEP  # read by kv_serde.ReceiveMemory

    def __init__(self) -> None:
        self._carver: SlabCarver | None = None

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype, count: int) -> list[np.ndarray]:
        if self._carver is None:
            self._carver = SlabCarver(mx.new_stream(mx.cpu))
        return kv_buffers(shape, dtype, count, self._carver)

    def prefault(self, decoding: bool) -> int:
        """Fault in the slab memory the next small handoffs land in (engine thread, once an
        iteration: a little while ``decoding``, else all that is due); bytes faulted."""
        if self._carver is None:
            return 0
        return self._carver.prefault(PREFAULT_STEP_BYTES if decoding else PREFAULT_AHEAD_BYTES)

    def pool_bytes(self) -> tuple[int, int]:
        """(bound, held now) of the freed buffers handoffs land in (the receive pool:
        docs/bulk-lanes.md#receive-pool)."""
        return engine_memory.receive_pool_bytes(), engine_memory.warm_bytes()


def adopt_layer(layer: CacheLayer, stream: mx.Stream | None = None) -> CacheLayer:
    """The layer with its arrays as MLX arrays (storage dtype: bf16 stays uint16).

    Tensors received into ``kv_buffers`` memory become views of that MLX
    memory; others are copied. Safe off the engine thread: neither the lazy
    view nor ``mx.array`` of a numpy buffer (it copies at construction)
    schedules MLX work; the bf16 view waits for ``from_cache_layer`` on the
    engine thread. ``stream``: the evaluating thread's (``unfilled.mlx_view``).
    """
    if layer.dtype not in _MX_DTYPES:
        raise HandoffError(f"unsupported KV dtype {layer.dtype!r}")
    arrays = {name: _as_mlx(a, stream) for name, a in layer.arrays().items()}
    return CacheLayer.of_arrays(layer.kind, arrays, layer.dtype, layer.offset, layer.meta)


def _as_mlx(x: np.ndarray | mx.array, stream: mx.Stream | None = None) -> mx.array:
    """The MLX array a ``kv_buffers`` view shows (one cut from a buffer with room: its
    ``kv_room`` entry remembers the buffer), else a copy of ``x`` into MLX."""
    if isinstance(x, mx.array):
        return x
    view = mlx_view(x, stream)
    if view is not None:
        return view
    room = mlx_room_view(x, stream)
    if room is None:
        return mx.array(x)
    kv_room.remember(*room)
    return room[0]


def _to_mlx(x: np.ndarray | mx.array) -> mx.array:
    """An array in its model dtype: uint16 storage is bfloat16's bits; others are as stored."""
    arr = _as_mlx(x)  # adopted layers are MLX already
    return arr.view(mx.bfloat16) if arr.dtype == mx.uint16 else arr


def from_cache_layer(layer: CacheLayer) -> Any:
    """Rebuild the mlx-lm leaf cache a ``CacheLayer`` was exported from (a KVCache received
    into buffers with room holds those buffers: its next tokens are written in place)."""
    cache, unevaluated = _rebuild(layer)
    mx.eval(unevaluated)
    return cache


def _rebuild(layer: CacheLayer) -> tuple[Any, list[mx.array]]:
    """``from_cache_layer``'s cache and the buffers with room it holds, which the caller
    evaluates before the first step: once evaluated, a bf16 view lets go of its input
    (the uint16 buffer), so no other array shares the memory decode writes in place."""
    if layer.dtype not in _MX_DTYPES:
        raise HandoffError(f"unsupported KV dtype {layer.dtype!r}")
    received = _with_room(layer)
    arrays = received or {name: _to_mlx(a) for name, a in layer.arrays().items()}
    cache = cache_layout.rebuild_leaf(layer.kind, arrays, layer.offset, layer.meta)
    nbytes = sum(a.nbytes for a in received.values()) if received else 0
    if nbytes >= cache_admission.MIN_LAYER_BYTES:
        cache_admission.keep_warm_when_freed(cache, nbytes)
    return cache, list(received.values()) if received else []


def _with_room(layer: CacheLayer) -> dict[str, mx.array] | None:
    """K and V as the whole buffers with room behind them (``kv_room``), in the model's
    dtype (not yet evaluated); None for a layer not received that way."""
    if layer.kind != "KVCache" or layer.keys is None:
        return None
    full = {"k": kv_room.take(layer.keys), "v": kv_room.take(layer.values)}
    if any(a is None for a in full.values()) or layer.keys.shape[2] != layer.offset:
        return None
    return {name: _to_mlx(a) for name, a in full.items()}


def to_cache_state(caches: list[Any], prompt_len: int | None = None) -> CacheState:
    return CacheState([to_cache_layer(c, prompt_len) for c in cache_layout.leaves(caches)])


def from_cache_state(state: CacheState, shape: list[int] | None = None) -> list[Any]:
    """The model's caches (``shape``: ``cache_layout.nesting``; None: one leaf per layer)."""
    rebuilt = [_rebuild(layer) for layer in state.layers]
    # One evaluation for every layer: 32 of them cost ~0.8 ms of CPU here, one ~0.1 ms.
    mx.eval([array for _, unevaluated in rebuilt for array in unevaluated])
    flat = [cache for cache, _ in rebuilt]
    return cache_layout.nest(flat, shape) if shape is not None else flat


def check_cache_state(
    state: CacheState, fingerprint: dict[str, Any], prompt_len: int, prefix_tokens: int = 0
) -> None:
    """Refuse a handed-off cache that this model cannot decode from (before allocating).

    ``prefix_tokens``: a delta handoff's, whose layers hold only the positions after it.
    """
    specs = ModelFingerprint.from_dict(fingerprint).layers
    if len(state.layers) != len(specs):
        raise HandoffError(f"cache has {len(state.layers)} layers, model has {len(specs)}")
    for i, (layer, spec) in enumerate(zip(state.layers, specs, strict=True)):
        if layer.kind != spec.kind:
            raise HandoffError(f"layer {i}: cache kind {layer.kind!r}, model uses {spec.kind!r}")
        if layer.keys is not None and layer.dtype != fingerprint["dtype"]:
            want = fingerprint["dtype"]
            raise HandoffError(f"layer {i}: KV dtype {layer.dtype}, model uses {want}")
        _check_layer_shape(i, layer, spec, prompt_len, prefix_tokens)


def _check_layer_shape(
    i: int, layer: CacheLayer, spec: Any, prompt_len: int, prefix_tokens: int
) -> None:
    held = layer.keys.shape[2] if layer.keys is not None and layer.keys.ndim == 4 else 1
    for array_spec in spec.arrays:
        arr, want = layer.array(array_spec.name), array_spec.shape_for(held)
        if arr is None or tuple(arr.shape) != want:
            got = None if arr is None else tuple(arr.shape)
            raise HandoffError(f"layer {i}: {array_spec.name} shape {got} does not fit {want}")
    if layer.offset != prompt_len:
        raise HandoffError(f"layer {i}: cache holds {layer.offset} tokens, prompt has {prompt_len}")
    if prefix_tokens and layer.kind != "KVCache":
        raise HandoffError(f"layer {i}: a {layer.kind} cannot take a delta handoff")
    if layer.kind == "KVCache" and held != layer.offset - prefix_tokens:
        after = f" after a prefix of {prefix_tokens}"
        raise HandoffError(f"layer {i}: {held} cached positions for offset {layer.offset}"
                           f"{after if prefix_tokens else ''}")
