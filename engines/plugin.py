"""Registers the MLX engine with the plugin manager (entry point ``mlx_engines``)."""

from __future__ import annotations

from mlxcel_plugin.engine_api import EngineConfig
from mlxcel_plugin.hookspecs import Register, hookimpl


def make_mlx_engine(model_path: str, config: EngineConfig):  # -> engines.mlx_engine.MlxEngine
    """Load ``model_path`` (an mlx-lm checkpoint) into an engine; MLX is imported only here.

    Under a ring of several ranks (``MLX_HOSTFILE``, as ``--shard-ranks`` or ``mlx.launch``
    set it) this process is rank 0 of a tensor-parallel engine (engines/sharding/engine.py).
    """
    from engines.mlx_engine import MlxEngine
    from engines.sharding.group import ring_group_from_env

    group = ring_group_from_env()
    if group is not None:
        from engines.sharding.ranks import lead

        return lead(model_path, config, group)
    if config.enable_lora:  # LoRA adapters: the engine that selects them per row
        from engines.lora.engine import LoraMlxEngine

        return LoraMlxEngine.from_path(model_path, config)
    return MlxEngine.from_path(model_path, config)


def make_synthetic_kv_engine(model_path: str, config: EngineConfig):  # -> MlxEngine
    """A zero-compute KV source for benchmarks (engines/synthetic_kv.py)."""
    from engines.synthetic_kv import make_synthetic_kv_engine as make

    return make(model_path, config)


@hookimpl
def mlxcel_register_engines(register: Register) -> None:
    register("mlx", make_mlx_engine)
    register("synthetic-kv", make_synthetic_kv_engine)
