"""The MLX engine's memory: budgets sized from the model, freed heap pages given back when idle.

Why: MLX keeps freed buffers for reuse up to its cache limit. A decode node's
received K/V land in MLX allocations (``kv_convert.kv_buffers``), and memory
fresh from the OS costs a page fault per page on first touch (0.4-7 CPU-s per
GiB here: 4 KiB pages, or huge pages the kernel compacts memory for; the link's
own work is ~0.3 s). So the limit is the **receive pool**'s (``[engine]
receive_pool_bytes``, auto: at most 2 GiB and a quarter of the KV budget:
``pool.receive_pool_bytes_for``): a finished handoff's buffers stay faulted in
for the next one (sizes on a grid: ``kv_serde.layer_buffers.room_grid``). Never the
whole KV budget: after a benchmark a decode node holding that much of a 135M
model's memory sat at 4.3 GB RSS. MLX frees anything beyond the limit at once.
What it keeps stays warm while the node serves: once the engine has had
nothing to do for ``IDLE_RELEASE_S`` it only asks glibc to return freed heap
pages (``give_back_to_os``). It used to empty MLX's cache too, so a decode node
that waited out a long prefill took the handoff into fresh pages.
"""

from __future__ import annotations

import logging
import queue
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxcel_plugin.engine_api import EngineConfig
from mlxcel_plugin.kv_serde.pool import give_back_to_os, receive_pool_bytes_for
from mlxcel_plugin.memory_budget import MemoryBudgets, budgets_for, with_kv_budget

log = logging.getLogger(__name__)

# Idle this long (no command, no work) before memory goes back: handoffs arriving
# back to back keep reusing warm buffers.
IDLE_RELEASE_S = 5.0
# MLX's cache limit is one per process and MLX cannot be asked for it: the receive pool
# bound this process last applied, for /metrics (``receive_pool_bytes``).
_applied_pool_bytes = [0]
_applied_cache_bytes = [0]  # MLX's cache limit this process applied (applied_cache_limit)


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights (quantized weights counted as stored)."""
    return int(sum(array.nbytes for _, array in tree_flatten(model.parameters())))


class EngineMemory:
    """One engine's budgets (its KV budget sized from the model's ``weights_bytes``: see
    ``model_bytes``) and its idle release."""

    def __init__(self, weights_bytes: int, config: EngineConfig):
        self.budgets: MemoryBudgets = budgets_for(config, weights_bytes)
        self.model_bytes = self.budgets.model_bytes
        self.config = with_kv_budget(config, self.model_bytes)
        self.receive_pool_bytes = receive_pool_bytes_for(
            self.budgets.kv_budget_bytes, self.model_bytes, self.budgets.machine_bytes,
            config.receive_pool_bytes)
        self.idle = IdleRelease()

    @property
    def cache_limit_bytes(self) -> int:
        """MLX's cache of freed buffers: the receive pool, or the general bound if larger."""
        return max(self.budgets.freed_cache_bytes, self.receive_pool_bytes)

    def apply(self) -> None:
        """Bound MLX's freed-buffer cache and say what the node runs with (at startup)."""
        mx.set_cache_limit(self.cache_limit_bytes)
        _applied_pool_bytes[0] = self.receive_pool_bytes
        _applied_cache_bytes[0] = self.cache_limit_bytes
        log.info("memory: %s; receive pool <= %d MiB (freed MLX buffers kept faulted in "
                 "for the next handoffs: resident once used)", self.budgets.describe(),
                 self.receive_pool_bytes >> 20)


def warm_bytes() -> int:
    """Freed MLX buffers held for reuse now (the receive pool's warm pages among them)."""
    return int(mx.get_cache_memory())


def receive_pool_bytes() -> int:
    """The receive pool's bound in force in this process (0 before an engine applied one)."""
    return _applied_pool_bytes[0]


def applied_cache_limit() -> int:
    """MLX's cache limit this process applied (0 before an engine applied one)."""
    return _applied_cache_bytes[0]


def release_memory() -> None:
    """Give glibc's freed heap pages back to the OS; MLX's bounded cache of freed buffers
    stays warm for the next handoff (docs/memory.md)."""
    give_back_to_os()


class IdleRelease:
    """Takes the engine's commands; gives memory back once after each busy spell."""

    def __init__(self, after_s: float = IDLE_RELEASE_S):
        self.after_s = after_s
        self.pending = False  # work was done since memory was last given back
        self.releases = 0

    def next_command(self, commands: queue.Queue[Any], block: bool) -> Any:
        """``commands.get(block)``; an idle wait first times out once to release memory."""
        if block and self.pending:
            try:
                return self._took(commands.get(timeout=self.after_s))
            except queue.Empty:
                release_memory()
                self.pending = False
                self.releases += 1
        return self._took(commands.get(block=block))

    def _took(self, command: Any) -> Any:
        self.pending = True
        return command
