"""Transfer strategies: exact round trips across dtypes, sizes, codecs; release timing; lanes."""

from __future__ import annotations

import random

import pytest

from mlxcel_plugin.builtin_plugin import builtin_codecs
from mlxcel_plugin.errors import PluginError
from mlxcel_plugin.kv_codecs import resolve_codec
from mlxcel_plugin.kv_serde import KVAssembler, assemble_messages
from mlxcel_plugin.plugins import load_plugins
from mlxcel_plugin.testing.caches import (
    assert_caches_equal,
    make_cache,
    make_fingerprint,
    make_header,
)
from mlxcel_plugin.transfer import (
    FullTransfer,
    LayerParallelTransfer,
    StrategyOptions,
    StreamedTransfer,
    make_strategy,
    plan_transfer,
)

CODECS = builtin_codecs()
STRATEGIES = [FullTransfer, StreamedTransfer, LayerParallelTransfer]


def options(codec: str = "none", lanes: int = 3, chunk_bytes: int = 16 * 1024):
    return StrategyOptions(resolve_codec(codec, CODECS), chunk_bytes=chunk_bytes, lanes=lanes)


def shuffled_after_begin(messages, seed):
    """Begin first, then every other message in a random order (worst case for LayerParallel)."""
    begins = [m for m in messages if m.kind == "begin"]
    rest = [m for m in messages if m.kind != "begin"]
    random.Random(seed).shuffle(rest)
    return [begins[0], *rest]


def assemble(messages, fingerprint):
    assembler = KVAssembler(fingerprint, CODECS)
    results = [r for r in map(assembler.feed, messages) if r is not None]
    assert len(results) == 1
    return results[0]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
@pytest.mark.parametrize("codec", ["none", "lz4"])
@pytest.mark.parametrize("tokens", [1, 255, 256, 257, 2000])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_round_trip_is_exact(strategy, codec, tokens, dtype):
    fingerprint = make_fingerprint(2, 2, 64, dtype, ["KVCache", "RotatingKVCache"])
    cache = make_cache(fingerprint, tokens, seed=tokens, rotating_max_size=256)
    header = make_header(fingerprint, tokens, codec=codec)
    messages = plan_transfer(strategy(options(codec)), header, cache)
    if strategy is LayerParallelTransfer:
        messages = shuffled_after_begin(messages, seed=tokens)
    result = assemble(messages, fingerprint)
    assert_caches_equal(result.cache, cache)
    assert result.header == header


def test_full_sends_its_begin_at_once_and_every_chunk_at_finish():
    """The begin goes while prefill computes (the decode node readies its buffers then);
    no K/V goes before prefill ends."""
    fingerprint = make_fingerprint(3, 2, 64, "float16")
    cache = make_cache(fingerprint, 30)
    strategy = FullTransfer(options())
    assert [m.kind for m in strategy.start(make_header(fingerprint, 30))] == ["begin"]
    assert all(strategy.add_layer(i, layer) == [] for i, layer in enumerate(cache.layers))
    kinds = [m.kind for m in strategy.finish()]
    assert kinds[-1] == "end" and set(kinds[:-1]) == {"chunk"}


def test_full_sends_layers_as_they_are_encoded_once_the_prefill_has_ended():
    """Layers encoded while prefill computes stay held; after ``prefill_ended`` the held ones
    and then each later layer go out as encoded, behind the begin; the cache arrives whole."""
    fingerprint = make_fingerprint(4, 2, 64, "float16")
    cache = make_cache(fingerprint, 30)
    header = make_header(fingerprint, 30)
    strategy = FullTransfer(options())
    begin = strategy.start(header)
    assert strategy.add_layer(0, cache.layers[0]) == []
    strategy.prefill_ended()
    first = strategy.add_layer(1, cache.layers[1])
    assert [m.header["layer"] for m in first] == sorted(m.header["layer"] for m in first)
    assert {m.header["layer"] for m in first} == {0, 1}
    later = [strategy.add_layer(i, cache.layers[i]) for i in (2, 3)]
    assert [{(m.kind, m.header["layer"]) for m in batch} for batch in later] == [
        {("chunk", 2)}, {("chunk", 3)}]
    end = strategy.finish()
    assert [m.kind for m in end] == ["end"]
    result = assemble([*begin, *first, *later[0], *later[1], *end], fingerprint)
    assert_caches_equal(result.cache, cache)


def test_streamed_releases_each_layer_as_it_arrives():
    fingerprint = make_fingerprint(3, 2, 64, "float16")
    cache = make_cache(fingerprint, 30)
    strategy = StreamedTransfer(options())
    assert [m.kind for m in strategy.start(make_header(fingerprint, 30))] == ["begin"]
    for index, layer in enumerate(cache.layers):
        chunks = strategy.add_layer(index, layer)
        assert chunks and {(m.kind, m.header["layer"], m.lane) for m in chunks} == {
            ("chunk", index, 0)
        }
    assert [m.kind for m in strategy.finish()] == ["end"]


def test_layer_parallel_opens_every_lane_and_deals_layers_round_robin():
    fingerprint = make_fingerprint(4, 2, 64, "float16")
    cache = make_cache(fingerprint, 64)
    strategy = LayerParallelTransfer(options(lanes=3, chunk_bytes=4096))
    begins = strategy.start(make_header(fingerprint, 64))
    assert [(m.kind, m.lane) for m in begins] == [("begin", 0), ("begin", 1), ("begin", 2)]
    for i, layer in enumerate(cache.layers):
        chunks = strategy.add_layer(i, layer)
        # Several chunks per layer (4 KiB chunks of 16 KiB tensors), all on the layer's lane.
        assert len(chunks) > 2 and {m.lane for m in chunks} == {i % 3}
    assert [(m.kind, m.lane) for m in strategy.finish()] == [("end", 0)]


def test_chunk_count_follows_chunk_bytes():
    fingerprint = make_fingerprint(1, 2, 64, "float16")  # 128 bytes per row
    cache = make_cache(fingerprint, 257)  # 514 rows per tensor
    messages = plan_transfer(
        StreamedTransfer(options(chunk_bytes=64 * 128)), make_header(fingerprint, 257), cache
    )
    rows = [m.header["rows"] for m in messages if m.kind == "chunk"]
    assert rows == [64] * 8 + [2] + [64] * 8 + [2]


def test_lossy_codec_travels_within_its_error_bound():
    fingerprint = make_fingerprint(2, 2, 64, "float16")
    cache = make_cache(fingerprint, 100)
    header = make_header(fingerprint, 100, codec="int8+lz4")
    result = assemble(
        plan_transfer(StreamedTransfer(options("int8+lz4")), header, cache), fingerprint
    )
    for got, want in zip(result.cache.layers, cache.layers, strict=True):
        error = abs(got.keys.astype("f4") - want.keys.astype("f4")).max()
        assert error <= abs(want.keys.astype("f4")).max() / 127


def test_make_strategy_uses_registered_names():
    registry = load_plugins(env={"MLXCEL_PLUGINS": "core"})
    strategies = registry.entries["transfer_strategy"]
    codecs = registry.entries["kv_codec"]
    strategy = make_strategy("layer-parallel", "shuffle+lz4", strategies, codecs, lanes=2)
    assert isinstance(strategy, LayerParallelTransfer)
    assert strategy.options.codec.name == "shuffle+lz4" and strategy.options.lanes == 2
    with pytest.raises(PluginError, match="full, layer-parallel, streamed"):
        make_strategy("carrier-pigeon", "none", strategies, codecs)


def test_builtin_plugin_registers_strategies_and_codecs():
    registry = load_plugins(env={"MLXCEL_PLUGINS": "core"})
    assert registry.names("transfer_strategy") == ["full", "layer-parallel", "streamed"]
    assert registry.names("kv_codec") == ["int4", "int8", "lz4", "none", "shuffle", "shuffle+lz4"]


def test_streaming_strategies_send_a_cells_rows_ahead_and_the_rest_with_the_layer():
    fp = make_fingerprint(num_layers=4, kv_heads=2, head_dim=64)
    cache = make_cache(fp, 24, seed=2)
    for strategy in (StreamedTransfer(StrategyOptions()), LayerParallelTransfer(
            StrategyOptions(lanes=3))):
        messages = list(strategy.start(make_header(fp, 24)))
        ahead = [m for i, layer in enumerate(cache.layers)
                 for m in strategy.add_rows(i, 0, {"k": layer.keys[:, :, :16],
                                                   "v": layer.values[:, :, :16]})]
        assert ahead and {m.header["row"] % 24 for m in ahead} == {0}
        if isinstance(strategy, LayerParallelTransfer):  # a layer's rows keep to one lane
            assert all(m.lane == m.header["layer"] % 3 for m in ahead)
        messages += ahead
        for i, layer in enumerate(cache.layers):
            messages += strategy.add_layer(i, layer)
        messages += strategy.finish()
        begin = next(m for m in messages if m.kind == "begin")
        rest = [m for m in messages if m.kind != "begin"]
        assert_caches_equal(assemble_messages([begin, *rest], fp, CODECS).cache, cache)
