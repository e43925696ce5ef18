"""A node's memory budgets, sized from its model and the machine (docs/memory.md).

``[engine] kv_memory_bytes`` left unset (0) means: half of the memory the
model's weights leave free on this machine, at least ``MIN_KV_BUDGET_BYTES``.
The budget bounds what KV a node *admits*; it is not allocated up front, so
a large one costs nothing while idle. Freed buffers kept warm for reuse are
bounded separately and much lower (``kv_serde.pool.pool_bytes_for``), so an
idle node's RSS is its weights plus a few hundred MiB whatever the budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from mlxcel_plugin.engine_api import EngineConfig
from mlxcel_plugin.kv_serde.pool import machine_memory_bytes, pool_bytes_for

logger = logging.getLogger(__name__)

MIB = 1 << 20
AUTO_KV_MEMORY_BYTES = 0  # ``kv_memory_bytes`` unset: sized by ``kv_budget_for``
MIN_KV_BUDGET_BYTES = 256 * MIB


@dataclass(frozen=True)
class MemoryBudgets:
    """What a node may hold: admitted KV, and freed buffers kept warm for reuse."""

    kv_budget_bytes: int
    freed_cache_bytes: int
    model_bytes: int
    machine_bytes: int
    kv_budget_auto: bool

    def describe(self) -> str:
        rule = " (auto: half of what the weights leave)" if self.kv_budget_auto else ""
        return (f"KV budget {self.kv_budget_bytes / MIB:.0f} MiB{rule}, freed buffers kept "
                f"<= {self.freed_cache_bytes / MIB:.0f} MiB, weights "
                f"{self.model_bytes / MIB:.0f} MiB, machine {self.machine_bytes / MIB:.0f} MiB")


def kv_budget_for(model_bytes: int, machine_bytes: int | None = None) -> int:
    """The default KV budget: half the memory the weights leave free, at least 256 MiB."""
    machine = machine_memory_bytes() if machine_bytes is None else machine_bytes
    return max(MIN_KV_BUDGET_BYTES, (machine - model_bytes) // 2)


def with_kv_budget(config: EngineConfig, model_bytes: int = 0,
                   machine_bytes: int | None = None) -> EngineConfig:
    """``config`` with its KV budget sized when it was left unset (0)."""
    if config.kv_memory_bytes > AUTO_KV_MEMORY_BYTES:
        return config
    return replace(config, kv_memory_bytes=kv_budget_for(model_bytes, machine_bytes))


def budgets_for(config: EngineConfig, model_bytes: int,
                machine_bytes: int | None = None) -> MemoryBudgets:
    """The budgets a node with this configuration and model runs with."""
    machine = machine_memory_bytes() if machine_bytes is None else machine_bytes
    kv = with_kv_budget(config, model_bytes, machine).kv_memory_bytes
    return MemoryBudgets(kv, pool_bytes_for(kv, model_bytes, machine), model_bytes, machine,
                         config.kv_memory_bytes <= AUTO_KV_MEMORY_BYTES)


def engine_config_of(engine: object, fallback: EngineConfig) -> EngineConfig:
    """The configuration an engine runs with (its sized KV budget), else ``fallback`` sized."""
    config = getattr(engine, "config", None)
    config = config if isinstance(config, EngineConfig) else fallback
    return with_kv_budget(config, engine_model_bytes(engine))


def engine_model_bytes(engine: object) -> int:
    """The engine's weights in bytes where it says (``model_bytes``), else 0."""
    value = getattr(engine, "model_bytes", 0)
    return value if isinstance(value, int) else 0
