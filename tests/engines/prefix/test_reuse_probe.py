"""The start-up probe: any-token reuse only where splitting a cell leaves K/V bits unchanged."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from engines.prefill import run_prefill
from engines.prefix.grid import PrefillGrid
from engines.prefix.reuse_probe import prefill_grid, probe_min_rows
from mlxcel_plugin.engine_api import EngineConfig, PrefixCacheConfig


class _ToyModel(nn.Module):
    """Two layers whose K/V are the tokens, nudged by the forward's row count if ``by_shape``."""

    def __init__(self, by_shape: bool):
        super().__init__()
        self.layers = [nn.Identity(), nn.Identity()]
        self.by_shape = by_shape

    def __call__(self, tokens: mx.array, cache: list) -> mx.array:
        rows = tokens.shape[1]
        x = tokens.astype(mx.float32)[:, None, :, None] * mx.ones((1, 1, 1, 4))
        if self.by_shape:
            x = x * (1 + 1e-6 * rows)
        for layer_cache in cache:
            layer_cache.make_mask(rows)
            layer_cache.update_and_fetch(x, x)
        return mx.zeros((1, rows, 8))


def test_a_backend_that_rounds_by_shape_gets_whole_cells_only():
    assert probe_min_rows(_ToyModel(by_shape=True), 64, vocab_size=100) is None


def test_a_shape_blind_backend_gets_the_fewest_rows_tried():
    assert probe_min_rows(_ToyModel(by_shape=False), 64, vocab_size=100) == 8
    assert probe_min_rows(_ToyModel(by_shape=False), 8, vocab_size=100) is None  # none < cell


def test_chunk_granularity_and_quantized_kv_skip_the_probe():
    model = _ToyModel(by_shape=False)
    assert prefill_grid(model, EngineConfig(chunk_size_tokens=64), _info()).min_rows == 8
    chunk = EngineConfig(chunk_size_tokens=64, prefix_cache=PrefixCacheConfig(granularity="chunk"))
    assert prefill_grid(model, chunk, _info()) == PrefillGrid(64)
    assert prefill_grid(model, EngineConfig(chunk_size_tokens=64, kv_bits=8), _info()) == \
        PrefillGrid(64)


def test_padded_keys_leave_plain_caches_holding_exactly_the_prompt(tiny_model_path):
    from engines.model_loader import load_mlx_model

    model, _ = load_mlx_model(tiny_model_path)
    tokens = tuple(range(5, 300))
    plain, padded = make_prompt_cache(model), make_prompt_cache(model)
    a = run_prefill(model, tokens, plain, PrefillGrid(128))
    b = run_prefill(model, tokens, padded, PrefillGrid(128, min_rows=8))
    assert [type(c) for c in padded] == [type(c) for c in plain]
    assert all(c.offset == len(tokens) for c in padded)
    # The same numbers up to rounding (padding changes only how sums are blocked).
    assert mx.allclose(a, b, atol=1e-4).item()


def _info():
    from mlxcel_plugin.engine_api import ModelInfo

    return ModelInfo("toy", {}, 4096, (0,), 100)
