"""Building a sharded engine's ranks: the leader a node holds, and a follower's loop.

Every rank runs the same start-up (config from the leader, load, shard, the
fingerprint's probe prefill, the engine's probes and warm-up): each forward
all-reduces across the ranks, so they must all run it, in the same order.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import numpy as np

from engines.engine_memory import model_bytes
from engines.model_loader import load_sharded_model, model_info
from engines.sharding.engine import FollowerEngine, LeaderEngine
from engines.sharding.group import whole_fingerprint
from engines.sharding.protocol import receive_config, send_config
from mlxcel_plugin.engine_api import (
    CacheLayer,
    CacheState,
    EmitToken,
    EngineConfig,
    EngineStats,
    GenerationRequest,
    LayerReady,
    ModelInfo,
    PrefillDone,
)
from mlxcel_plugin.memory_budget import with_kv_budget

Group = mx.distributed.Group


class ShardedEngine:
    """The ``Engine`` a node holds for a sharded model: rank 0, seen as the whole model.

    ``info`` carries the unsharded fingerprint (all KV heads), which is what
    handoffs carry; the leader's own engine works on its rank's heads.
    """

    def __init__(self, leader: LeaderEngine, info: ModelInfo):
        self.leader = leader
        self.info = info

    @property
    def ranks(self) -> int:
        return self.leader.group.size()

    @property
    def config(self) -> EngineConfig:
        """What every rank runs with (the KV budget sized on rank 0; each holds its heads)."""
        return self.leader.config

    @property
    def model_bytes(self) -> int:
        """This process's weights: rank 0's slice (its receive memory is sized from it)."""
        return self.leader.model_bytes

    def start(self) -> None:
        self.leader.start()

    def close(self) -> None:
        self.leader.close()  # STOP reaches the followers, which then exit

    def generate(self, request: GenerationRequest, emit: EmitToken) -> None:
        self.leader.generate(request, emit)

    def prefill(self, request: GenerationRequest, on_done: PrefillDone,
                on_layer: LayerReady | None = None) -> None:
        self.leader.prefill(request, on_done, on_layer)

    def decode(self, request: GenerationRequest, first_token: int, cache: CacheState,
               emit: EmitToken) -> None:
        self.leader.decode(request, first_token, cache, emit)

    def cancel(self, request_id: str) -> None:
        self.leader.cancel(request_id)

    def stats(self) -> EngineStats:
        return self.leader.stats()

    def adopt_layer(self, layer: CacheLayer) -> CacheLayer:
        return self.leader.adopt_layer(layer)

    def kv_buffers(self, shape: tuple[int, ...], dtype: np.dtype, count: int) -> list[Any]:
        return self.leader.kv_buffers(shape, dtype, count)


def lead(model_path: str, config: EngineConfig, group: Group) -> ShardedEngine:
    """Rank 0: load its slice, tell the followers the engine config, build alongside them.

    The config sent is the effective one (the KV budget sized here): every rank must
    take the same admission decisions, whatever memory its own machine has.
    """
    model, model_config = load_sharded_model(model_path, group)
    config = with_kv_budget(config, model_bytes(model))
    send_config(group, config)
    leader = LeaderEngine(model, model_info(model_path, model, model_config), config, group)
    whole = whole_fingerprint(leader.info.fingerprint, group.size())
    return ShardedEngine(leader, dataclasses.replace(leader.info, fingerprint=whole))


def follow(model_path: str, group: Group) -> None:
    """Ranks 1..N-1: build with the leader's config, then run its steps until it stops."""
    model, model_config = load_sharded_model(model_path, group)
    config = receive_config(group)
    follower = FollowerEngine(model, model_info(model_path, model, model_config), config, group)
    follower.serve_forever()
