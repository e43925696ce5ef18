"""Sharded engines' pieces in one process: KV heads, fingerprints, framing, the protocol.

The 2-rank runs are tests/engines/sharding/test_ranks.py and
tests/integration/test_sharded_roles.py.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engines.engine_commands import Cancel, Decode, Generate, Prefill
from engines.model_loader import load_sharded_model
from engines.sharding import group as sharding
from engines.sharding import protocol as sharding_protocol
from engines.sharding.group import (
    FRAME_BYTES,
    broadcast_bytes,
    gather_layer,
    own_heads,
    split_state,
    whole_fingerprint,
)
from engines.tiny_models import ensure_arch_model
from mlxcel_plugin.engine_api import (
    CacheLayer,
    CacheState,
    EngineConfig,
    GenerationRequest,
    PrefixCacheConfig,
    SamplingParams,
)
from mlxcel_plugin.errors import ConfigError, HandoffError
from tests.conftest import model_cache_root


def kv_layer(heads: int = 4, tokens: int = 3, kind: str = "KVCache") -> CacheLayer:
    keys = np.arange(heads * tokens * 2, dtype=np.float32).reshape(1, heads, tokens, 2)
    return CacheLayer(kind, keys, -keys, "float32", tokens, {"max_size": 8} if kind != "KVCache"
                      else {})


def test_each_rank_keeps_a_contiguous_block_of_heads():
    whole = kv_layer(heads=4).keys
    assert own_heads(whole, 0, 2).tolist() == whole[:, :2].tolist()
    assert own_heads(whole, 1, 2).tolist() == whole[:, 2:].tolist()
    with pytest.raises(HandoffError, match="do not split"):
        own_heads(whole, 0, 3)


def test_split_then_concatenated_is_the_whole_layer():
    layer = kv_layer(kind="RotatingKVCache")
    parts = [split_state(CacheState([layer]), rank, 2).layers[0] for rank in range(2)]
    assert all(p.keys.shape == (1, 2, 3, 2) and p.kind == "RotatingKVCache" for p in parts)
    assert all(p.offset == 3 and p.meta == {"max_size": 8} for p in parts)
    assert np.array_equal(np.concatenate([p.keys for p in parts], axis=1), layer.keys)
    assert np.array_equal(np.concatenate([p.values for p in parts], axis=1), layer.values)


def test_recurrent_state_is_not_split():
    state = CacheLayer("ArraysCache", None, None, "float32", 3, {"size": 1},
                       {"s0": np.zeros((1, 4, 8), np.float32)})
    with pytest.raises(HandoffError, match="cannot be split"):
        split_state(CacheState([state]), 0, 2)


def test_the_whole_fingerprint_has_every_rank_s_heads():
    spec = {"name": "k", "shape": [1, 1, 0, 16], "dtype": "float32", "grow_axis": 2}
    local = {"kv_heads": 1, "head_dim": 16, "layers": [{"kind": "KVCache", "arrays": [spec]}]}
    whole = whole_fingerprint(local, 2)
    assert whole["kv_heads"] == 2 and whole["layers"][0]["arrays"][0]["shape"] == [1, 2, 0, 16]
    assert local["kv_heads"] == 1 and spec["shape"][1] == 1  # the rank's own is left alone
    fixed = {"layers": [{"kind": "ArraysCache", "arrays": [{**spec, "grow_axis": None}]}]}
    with pytest.raises(ConfigError, match="cannot be sharded"):
        whole_fingerprint(fixed, 2)


@pytest.mark.parametrize("size", [0, 5, FRAME_BYTES - 8, FRAME_BYTES - 7, 3 * FRAME_BYTES])
def test_a_message_of_any_length_goes_through_the_frame(size: int):
    group = mx.distributed.init()  # one rank: the sum is the leader's own frame
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    assert broadcast_bytes(group, payload) == payload


def test_gathering_on_one_rank_is_the_layer_itself():
    layer = kv_layer()
    got = gather_layer(mx.distributed.init(), layer)
    assert np.array_equal(got.keys, layer.keys) and np.array_equal(got.values, layer.values)


class FakeRing:
    """What the leader broadcast, replayed to a follower (no collectives)."""

    def __init__(self) -> None:
        self.frames: deque[Any] = deque()
        self.leading = True

    def bytes(self, _group: Any, payload: bytes | None) -> bytes:
        if self.leading:
            self.frames.append(payload)
            return payload
        return self.frames.popleft()

    def array(self, _group: Any, array: Any, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
        if self.leading:
            self.frames.append(np.array(array))
            return mx.array(array)
        got = mx.array(self.frames.popleft())
        assert got.shape == shape and got.dtype == dtype
        return got


@pytest.fixture
def ring(monkeypatch: pytest.MonkeyPatch) -> FakeRing:
    fake = FakeRing()
    monkeypatch.setattr(sharding_protocol, "broadcast_bytes", fake.bytes)
    monkeypatch.setattr(sharding_protocol, "broadcast_array", fake.array)
    return fake


REQUEST = GenerationRequest("r1", (1, 2, 3), 9, SamplingParams(temperature=0.5, seed=4), (7,))


def test_commands_reach_a_follower_as_sent(ring: FakeRing):
    layer = kv_layer()
    layer.extra["k.scales"] = np.ones((1, 4, 3, 1), np.float16)
    for command in (Generate(REQUEST, print), Prefill(REQUEST, print, None),
                    Decode(REQUEST, 42, CacheState([layer]), print), Cancel("r1")):
        sharding_protocol.send_command(None, command)
    sharding_protocol.send_tokens(None, [5, 6])
    sharding_protocol.send_tokens(None, [8], quiet=True, row_cost=0.1 + 0.2)
    sharding_protocol.send_end(None, True)
    sharding_protocol.send_end(None, False)
    ring.leading = False
    assert sharding_protocol.receive(None) == ("generate", {"request": REQUEST})
    assert sharding_protocol.receive(None) == ("prefill", {"request": REQUEST})
    op, decode = sharding_protocol.receive(None)
    got = decode["cache"].layers[0]
    assert op == "decode" and decode["first_token"] == 42 and decode["request"] == REQUEST
    assert np.array_equal(np.array(got.keys), layer.keys) and got.kind == "KVCache"
    assert np.array_equal(np.array(got.extra["k.scales"]), layer.extra["k.scales"])
    assert sharding_protocol.receive(None) == ("cancel", {"request_id": "r1"})
    assert sharding_protocol.receive_step(None) == ([5, 6], False, None)
    # No END next iteration; the leader's speculation row cost, to the last bit.
    assert sharding_protocol.receive_step(None) == ([8], True, 0.1 + 0.2)
    assert [sharding_protocol.receive(None)[0] for _ in range(2)] == ["end", "stop"]


def test_a_failed_prefill_and_a_stray_message_read_as_such(ring: FakeRing):
    sharding_protocol.send_failed(None)
    sharding_protocol.send_end(None, True)
    ring.leading = False
    assert sharding_protocol.receive_tokens(None) is None
    with pytest.raises(sharding_protocol.ShardDiverged, match="expected the leader's tokens"):
        sharding_protocol.receive_tokens(None)


def test_followers_take_the_leader_s_engine_config(ring: FakeRing):
    config = EngineConfig(max_batch_size=3, chunk_size_tokens=16, kv_memory_bytes=1 << 30,
                          prefix_cache=PrefixCacheConfig(max_bytes=1 << 20))
    sharding_protocol.send_config(None, config)
    ring.leading = False
    assert sharding_protocol.receive_config(None) == config


def test_a_model_without_tensor_parallel_support_is_refused():
    mamba = ensure_arch_model("mamba", root=model_cache_root())
    with pytest.raises(ConfigError, match="no tensor-parallel shard"):
        load_sharded_model(mamba, mx.distributed.init())


def test_a_node_sizes_its_memory_from_rank_0():
    from types import SimpleNamespace

    from engines.sharding.ranks import ShardedEngine
    from mlxcel_plugin.memory_budget import engine_config_of, engine_model_bytes

    config = EngineConfig(kv_memory_bytes=1 << 30)
    leader = SimpleNamespace(config=config, model_bytes=12345, group=mx.distributed.init())
    engine = ShardedEngine(leader, None)
    assert engine_config_of(engine, EngineConfig()) == config
    assert engine_model_bytes(engine) == 12345 and engine.ranks == 1


def test_no_hostfile_means_no_ring():
    assert sharding.ring_group_from_env({}) is None
