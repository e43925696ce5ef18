"""The MLX engine's memory: budgets from the model; when idle, heap pages go back and MLX's
bounded cache of freed buffers stays warm for the next handoff."""

from __future__ import annotations

import queue
import threading

import mlx.core as mx
import pytest

from engines.engine_memory import EngineMemory, IdleRelease, model_bytes
from engines.mlx_engine import MlxEngine
from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest
from tests.engines import support

MIB = 1 << 20


def test_a_command_waiting_is_taken_without_releasing():
    commands: queue.Queue[str] = queue.Queue()
    idle = IdleRelease(after_s=60)
    idle.pending = True
    commands.put("work")
    assert idle.next_command(commands, block=True) == "work"
    assert idle.releases == 0 and idle.pending


def test_memory_goes_back_once_per_idle_spell():
    commands: queue.Queue[str] = queue.Queue()
    idle = IdleRelease(after_s=0.01)
    idle.pending = True  # work was done
    mx.eval(mx.zeros((MIB,)) + 1)  # a freed buffer in MLX's cache
    held = threading.Event()

    def feed_after_release() -> None:
        for _ in range(12000):  # up to a minute
            if idle.releases:
                break
            held.wait(0.005)
        commands.put("next")

    feeder = threading.Thread(target=feed_after_release)
    feeder.start()
    assert idle.next_command(commands, block=True) == "next"
    feeder.join()
    # Heap pages went back; the freed MLX buffer stays warm (bounded by the cache limit).
    assert idle.releases == 1 and mx.get_cache_memory() >= 4 * MIB
    with pytest.raises(queue.Empty):  # busy: never waits, never releases
        idle.next_command(commands, block=False)
    assert idle.releases == 1


def test_engine_memory_sizes_the_budget_from_the_weights(tiny_model_path):
    engine = MlxEngine.from_path(str(tiny_model_path), EngineConfig(warmup=False))
    weights = model_bytes(engine.model)
    assert engine.model_bytes == weights > 0
    assert engine.config.kv_memory_bytes == engine._memory.budgets.kv_budget_bytes > 0
    memory = EngineMemory(model_bytes(engine.model), EngineConfig(kv_memory_bytes=256 * MIB))
    memory.apply()
    assert memory.config.kv_memory_bytes == 256 * MIB
    assert mx.set_cache_limit(memory.budgets.freed_cache_bytes) == 64 * MIB  # the limit set


def test_an_idle_engine_keeps_its_warm_buffers_within_the_bound(tiny_model_path):
    engine = MlxEngine.from_path(str(tiny_model_path), EngineConfig(warmup=False))
    engine._memory.idle.after_s = 0.05
    engine.start()
    try:
        events = support.generate(engine, GenerationRequest("r", tuple(range(3, 200)), 8))
        assert len(events.events) == 8
        warm = mx.get_cache_memory()
        for _ in range(6000):  # up to a minute
            if engine._memory.idle.releases:
                break
            threading.Event().wait(0.01)
        assert engine._memory.idle.releases == 1
        assert 0 < mx.get_cache_memory() <= engine._memory.cache_limit_bytes
        assert mx.get_cache_memory() >= warm  # nothing warm was dropped
    finally:
        engine.close()
