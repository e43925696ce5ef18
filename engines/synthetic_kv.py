"""A zero-compute KV source: an MLX engine whose prefill fills K/V instead of computing them.

For measuring the KV plane alone (``loadtests/bench_kv_plane.py``): a prompt
of any length fills the model's MLX caches at memory speed, so what a handoff
costs is all that is left to measure. Everything around the forward is the
product's own (``MlxEngine``: the prefill loop, per-layer callbacks, rows sent
ahead, adoption, the decode batch).

The "checkpoint" is a directory holding only ``config.json``: a llama with the
K/V shape asked for (default 8B-shaped: 32 layers, 8 KV heads, head_dim 128,
bf16) and a narrow body (hidden 64), built with random weights from a seed, so
two nodes on one machine hold the same model and fingerprint. Forwards of more
than one token (prefill's chunks) write a fixed random pattern into every
layer's cache and return zero logits; a single-token forward (prefill's last
token, every decode step) runs the real model over the filled cache, so a
decode node really attends over what it adopted.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import llama

from engines.mlx_engine import MlxEngine
from engines.model_loader import model_info
from mlxcel_plugin.engine_api import EngineConfig
from mlxcel_plugin.errors import ConfigError

MARKER = "mlxcel_synthetic_kv"  # config.json key: this directory is a synthetic KV source
PATTERN_TOKENS = 1024  # the fill repeats every this many positions (per head: 256 KiB at d=128)
BODY: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "rms_norm_eps": 1e-5,
    "vocab_size": 1024, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "max_position_embeddings": 131072,
}


def synthetic_config(layers: int = 32, kv_heads: int = 8, head_dim: int = 128,
                     dtype: str = "bfloat16", seed: int = 0) -> dict[str, Any]:
    """The config.json of a synthetic KV source with this K/V shape."""
    return {**BODY, "num_hidden_layers": layers, "num_attention_heads": kv_heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim, "torch_dtype": dtype,
            MARKER: {"seed": seed}}


def write_synthetic_checkpoint(out_dir: str | Path, **shape: Any) -> Path:
    """A directory ``--model`` accepts for ``--engine synthetic-kv`` (see synthetic_config)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(synthetic_config(**shape), indent=1) + "\n")
    return out


def kv_bytes_per_token(config: dict[str, Any]) -> int:
    """K and V bytes one prompt token adds over every layer."""
    itemsize = mx.finfo(getattr(mx, config["torch_dtype"])).bits // 8
    per_layer = 2 * config["num_key_value_heads"] * config["head_dim"] * itemsize
    return config["num_hidden_layers"] * per_layer


class SyntheticKVModel(llama.Model):
    """llama whose multi-token forwards fill the caches with a fixed pattern (no compute)."""

    def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: Any = None):
        if cache is None or inputs.shape[1] == 1 or input_embeddings is not None:
            return super().__call__(inputs, cache, input_embeddings)
        length = inputs.shape[1]
        for index, layer_cache in enumerate(cache):
            keys, values = self._pattern(index, layer_cache.offset, length)
            # mlx-lm's KVCache grows by a fixed step, copying all it holds each time (an 8k
            # fill copies ~16x its size): grow by doubling, so filling costs ~one copy.
            layer_cache.step = max(layer_cache.step, layer_cache.offset)
            layer_cache.update_and_fetch(keys, values)
        return mx.zeros((inputs.shape[0], length, self.args.vocab_size), dtype=mx.float32)

    def _pattern(self, layer: int, offset: int, length: int) -> tuple[mx.array, mx.array]:
        """Positions ``[offset, offset + length)`` of layer ``layer``: rows of the pattern."""
        first = offset + 97 * layer  # layers differ, so no layer repeats another's bytes
        return self._rows(first, length), -self._rows(first + PATTERN_TOKENS // 2, length)

    def _rows(self, first: int, length: int) -> mx.array:
        """Pattern rows ``first, first + 1, ...`` (mod its length): a slice where it can be."""
        source = self._kv_pattern  # twice over; "_": not a parameter (valid_parameter_filter)
        start = first % PATTERN_TOKENS
        if length <= PATTERN_TOKENS:
            return source[:, :, start:start + length]
        return mx.take(source, (mx.arange(length) + start) % PATTERN_TOKENS, axis=2)


def load_synthetic_model(model_path: str | Path) -> tuple[SyntheticKVModel, dict[str, Any]]:
    """The model a synthetic checkpoint describes, random weights from its seed."""
    path = Path(model_path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: no readable config.json ({exc})") from exc
    if MARKER not in config:
        raise ConfigError(f"{path} is not a synthetic KV source (no {MARKER!r} in config.json;"
                          " engines/synthetic_kv.py write_synthetic_checkpoint makes one)")
    dtype = getattr(mx, config["torch_dtype"])
    mx.random.seed(int(config[MARKER]["seed"]))
    model = SyntheticKVModel(llama.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    shape = (1, config["num_key_value_heads"], PATTERN_TOKENS, config["head_dim"])
    pattern = mx.random.normal(shape).astype(dtype)
    model._kv_pattern = mx.concatenate([pattern, pattern], axis=2)  # any window is a slice
    mx.eval(model.parameters(), model._kv_pattern)
    return model, config


def make_synthetic_kv_engine(model_path: str, config: EngineConfig) -> MlxEngine:
    """The engine for ``--engine synthetic-kv``: an ``MlxEngine`` over the synthetic model.

    The prefix cache reuses whole chunks only: the start-up probe of any-token
    reuse measures a model's kernels, which a filled cache does not exercise.
    """
    model, model_config = load_synthetic_model(model_path)
    prefix = dataclasses.replace(config.prefix_cache, granularity="chunk")
    config = dataclasses.replace(config, prefix_cache=prefix)
    return MlxEngine(model, model_info(model_path, model, model_config), config)
