"""Tensor-parallel ranks over an ``mx.distributed`` ring: the group, broadcasts, KV heads.

Rank 0 (the leader) serves the node; every other rank (a follower) holds its
slice of the weights (mlx-lm's ``model.shard``) and runs the same forwards.
Each rank's caches hold its own KV heads (rank r: heads ``[r*h, (r+1)*h)``,
h = KV heads / ranks), so a handoff always carries whole K/V: a sharded
prefill gathers every rank's heads before sending, a sharded decode node
broadcasts what it received and each rank keeps its heads (docs/design.md,
"Sharded roles"). The peer never needs to know how the other side is split.

The ring backend is mlx's (``MLX_HOSTFILE``: a JSON list, one ``["ip:port"]``
per rank; ``MLX_RANK``: this process's index), exactly as ``mlx.launch`` sets it.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcel_plugin.engine_api import CacheLayer, CacheState
from mlxcel_plugin.errors import ConfigError, HandoffError

log = logging.getLogger(__name__)
HOSTFILE_ENV = "MLX_HOSTFILE"
RANK_ENV = "MLX_RANK"
HEAD_AXIS = 1  # K/V are [1, kv_heads, tokens, head_dim]
# One collective carries a message up to this size (a length word, then the bytes); a
# longer one takes a second. Each collective costs ~2 ms on two loaded loopback cores.
FRAME_BYTES = 1024
_LENGTH_BYTES = 8
# mlx gives up connecting to a rank after ~30 s; ranks may start minutes apart (a
# large model loading, hosts started by hand), so joining is retried this long.
RING_JOIN_TIMEOUT_S = 600.0


def ring_group_from_env(env: Mapping[str, str] | None = None) -> mx.distributed.Group | None:
    """The ring group ``MLX_HOSTFILE``/``MLX_RANK`` describe; None when not sharded.

    Blocks until every rank has joined (mlx's ring connects all ranks at init).
    """
    env = os.environ if env is None else env
    if not env.get(HOSTFILE_ENV):
        return None
    deadline = time.monotonic() + RING_JOIN_TIMEOUT_S
    while True:
        try:
            group = mx.distributed.init(strict=True, backend="ring")
        except RuntimeError as exc:  # "[ring] Couldn't connect": a rank not listening yet
            if "connect" not in str(exc) or time.monotonic() > deadline:
                raise
            log.info("shard ring: waiting for the other ranks (%s)", exc)
            continue
        return group if group.size() > 1 else None


def _sum(group: mx.distributed.Group, x: mx.array) -> mx.array:
    out = mx.distributed.all_sum(x, group=group, stream=mx.cpu)
    mx.eval(out)
    return out


def broadcast_bytes(group: mx.distributed.Group, payload: bytes | None) -> bytes:
    """Rank 0's ``payload`` on every rank (the others pass None): a sum with zeros elsewhere."""
    leader = group.rank() == 0
    frame = np.zeros(FRAME_BYTES, dtype=np.uint8)
    if leader:
        data = payload or b""
        frame[:_LENGTH_BYTES] = np.frombuffer(len(data).to_bytes(_LENGTH_BYTES, "little"),
                                             np.uint8)
        inline = data[: FRAME_BYTES - _LENGTH_BYTES]
        frame[_LENGTH_BYTES : _LENGTH_BYTES + len(inline)] = np.frombuffer(inline, np.uint8)
    got = np.array(_sum(group, mx.array(frame)))
    length = int.from_bytes(got[:_LENGTH_BYTES].tobytes(), "little")
    head = got[_LENGTH_BYTES : _LENGTH_BYTES + length].tobytes()
    rest = length - len(head)
    if rest <= 0:
        return head
    tail = np.frombuffer(payload[len(head):], np.uint8) if leader else np.zeros(rest, np.uint8)
    return head + np.array(_sum(group, mx.array(tail))).tobytes()


def broadcast_array(group: mx.distributed.Group, array: Any, shape: tuple[int, ...],
                    dtype: mx.Dtype) -> mx.array:
    """Rank 0's ``array`` (numpy or MLX, storage dtype) on every rank, as MLX."""
    mine = mx.array(array) if group.rank() == 0 else mx.zeros(shape, dtype=dtype)
    return _sum(group, mine)


def gather_heads(group: mx.distributed.Group, x: Any) -> np.ndarray:
    """Every rank's ``[1, h, ...]`` slice of one array -> the whole ``[1, ranks*h, ...]``."""
    parts = mx.distributed.all_gather(mx.array(x), group=group, stream=mx.cpu)  # [ranks, h, ...]
    mx.eval(parts)
    return np.array(parts.reshape(1, -1, *parts.shape[2:]))


def own_heads(x: Any, rank: int, ranks: int) -> Any:
    """This rank's KV heads of a whole ``[1, heads, ...]`` array."""
    heads = x.shape[HEAD_AXIS]
    if heads % ranks:
        raise HandoffError(f"{heads} KV heads do not split over {ranks} ranks")
    per_rank = heads // ranks
    return x[:, rank * per_rank : (rank + 1) * per_rank]


def _layer_arrays(layer: CacheLayer) -> dict[str, Any]:
    arrays = {"k": layer.keys, "v": layer.values, **layer.extra}
    return {name: a for name, a in arrays.items() if a is not None}


def _with_arrays(layer: CacheLayer, arrays: dict[str, Any]) -> CacheLayer:
    extra = {name: arrays[name] for name in layer.extra}
    return CacheLayer(layer.kind, arrays.get("k"), arrays.get("v"), layer.dtype, layer.offset,
                      dict(layer.meta), extra)


def check_splittable(layer: CacheLayer) -> None:
    """Only K/V-shaped arrays split by head; recurrent state (SSM) has no head axis to split."""
    if layer.kind == "ArraysCache" or layer.keys is None or layer.keys.ndim != 4:
        raise HandoffError(f"a {layer.kind} layer cannot be split across shard ranks")


def gather_layer(group: mx.distributed.Group, layer: CacheLayer) -> CacheLayer:
    """A local layer (this rank's heads) -> the whole layer; every rank calls it in step."""
    check_splittable(layer)
    return _with_arrays(layer, {n: gather_heads(group, a) for n, a in _layer_arrays(layer).items()})


def split_state(state: CacheState, rank: int, ranks: int) -> CacheState:
    """A whole handed-off cache -> this rank's heads of every layer."""
    layers = []
    for layer in state.layers:
        check_splittable(layer)
        arrays = {n: own_heads(a, rank, ranks) for n, a in _layer_arrays(layer).items()}
        layers.append(_with_arrays(layer, arrays))
    return CacheState(layers)


def whole_fingerprint(local: dict[str, Any], ranks: int) -> dict[str, Any]:
    """The fingerprint of the unsharded model, from one rank's: KV heads times ``ranks``.

    Peers compare fingerprints; a sharded node must look like the model it serves.
    """
    whole = copy.deepcopy(local)
    whole["kv_heads"] = int(local.get("kv_heads", 0)) * ranks
    for layer in whole.get("layers", []):
        for spec in layer.get("arrays", []):
            if spec.get("grow_axis") is None:
                raise ConfigError(f"a {layer.get('kind')} layer cannot be sharded (no head axis)")
            spec["shape"][HEAD_AXIS] *= ranks
    return whole
