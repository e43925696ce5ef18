"""A node's KV budget sized from its model and the machine when not configured."""

from __future__ import annotations

from dataclasses import dataclass

from mlxcel_plugin.config import ServerConfig
from mlxcel_plugin.engine_api import EngineConfig
from mlxcel_plugin.kv_serde.convert import cast_fingerprint
from mlxcel_plugin.kv_serde.header import HandoffHeader, SerializableSamplingState
from mlxcel_plugin.kv_serde.pool import pool_bytes_for
from mlxcel_plugin.memory_budget import (
    MIN_KV_BUDGET_BYTES,
    budgets_for,
    engine_config_of,
    kv_budget_for,
    with_kv_budget,
)
from mlxcel_plugin.nodes.decode_node import DecodeNode, DecodeNodeParts
from mlxcel_plugin.nodes.roles import decode_scheduler_config
from mlxcel_plugin.scheduling import DecodeSchedulerConfig
from mlxcel_plugin.testing.fake_engine import FakeEngine

GIB = 1 << 30
MIB = 1 << 20


def test_unset_budget_is_half_of_what_the_weights_leave():
    assert EngineConfig().kv_memory_bytes == 0  # unset by default
    assert kv_budget_for(model_bytes=2 * GIB, machine_bytes=18 * GIB) == 8 * GIB
    sized = with_kv_budget(EngineConfig(), model_bytes=2 * GIB, machine_bytes=18 * GIB)
    assert sized.kv_memory_bytes == 8 * GIB


def test_a_small_machine_still_gets_the_minimum_budget():
    assert kv_budget_for(model_bytes=8 * GIB, machine_bytes=8 * GIB) == MIN_KV_BUDGET_BYTES


def test_a_configured_budget_is_kept():
    config = EngineConfig(kv_memory_bytes=128 * MIB)
    assert with_kv_budget(config, model_bytes=GIB, machine_bytes=64 * GIB) is config


def test_freed_buffers_kept_are_bounded_far_below_the_budget():
    budgets = budgets_for(EngineConfig(), model_bytes=270 * MIB, machine_bytes=128 * GIB)
    assert budgets.kv_budget_auto and budgets.kv_budget_bytes > 60 * GIB
    assert budgets.freed_cache_bytes <= 512 * MIB
    assert "KV budget" in budgets.describe() and "auto" in budgets.describe()
    small = budgets_for(EngineConfig(kv_memory_bytes=256 * MIB), 270 * MIB, 128 * GIB)
    assert not small.kv_budget_auto and small.freed_cache_bytes == 64 * MIB


@dataclass
class _Engine:
    config: EngineConfig
    model_bytes: int


def test_nodes_read_the_engine_s_sized_budget():
    engine = _Engine(EngineConfig(kv_memory_bytes=3 * GIB), GIB)
    assert engine_config_of(engine, EngineConfig()).kv_memory_bytes == 3 * GIB
    fallback = engine_config_of(object(), EngineConfig(kv_memory_bytes=5 * GIB))
    assert fallback.kv_memory_bytes == 5 * GIB
    assert engine_config_of(object(), EngineConfig()).kv_memory_bytes >= MIN_KV_BUDGET_BYTES


def test_decode_scheduler_sizes_an_unset_budget():
    assert DecodeSchedulerConfig.from_engine_config(EngineConfig()).kv_budget_bytes > 0


def test_a_decode_node_sizes_its_receive_pool_from_the_engine_s_budget():
    engine = FakeEngine(config=EngineConfig(kv_memory_bytes=256 * MIB))
    engine.model_bytes = 64 * MIB
    sized = engine_config_of(engine, EngineConfig())
    scheduler = decode_scheduler_config(ServerConfig(), sized)
    assert scheduler.kv_budget_bytes == 256 * MIB
    parts = DecodeNodeParts(engine, scheduler, {}, kv_budget_bytes=sized.kv_memory_bytes,
                            model_bytes=engine.model_bytes)
    node = DecodeNode(parts, "decode-test")
    pool = node.receiver.memory.pool
    assert pool.max_bytes == pool_bytes_for(256 * MIB, 64 * MIB) == 64 * MIB


def test_a_converting_handoff_is_reserved_as_the_decode_node_holds_it():
    """A float16 sender's K/V widen to float32 here: the budget counts the float32 bytes."""
    engine = FakeEngine(config=EngineConfig(kv_memory_bytes=256 * MIB))
    scheduler = decode_scheduler_config(ServerConfig(), engine_config_of(engine, EngineConfig()))
    node = DecodeNode(DecodeNodeParts(engine, scheduler, {}), "decode-test")
    assert node.fingerprint.dtype == "float32"
    sent = cast_fingerprint(node.fingerprint, "float16")
    sampling = SerializableSamplingState(max_tokens=16)
    node._admit_begin(HandoffHeader("r1", "h1", 0, sent, 48, 5, sampling=sampling))
    held = node.fingerprint.kv_bytes(48 + 16)
    assert held == 2 * sent.kv_bytes(48 + 16)
    assert node.scheduler.stats().kv_used_bytes == held
