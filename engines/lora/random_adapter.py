"""A seeded random LoRA adapter for a model, in mlx-lm's format (tests and benchmarks).

Both A and B are non-zero (a freshly initialised mlx-lm adapter has B = 0 and
changes nothing), scaled so the adapted model's greedy output differs from the
base's while its logits stay far from ties.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from engines.lora.files import CONFIG_FILE, WEIGHTS_FILE
from engines.lora.multi_lora import linear_dims

DEFAULT_KEYS = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")


def write_random_adapter(model: nn.Module, out_dir: str | Path, *, seed: int, rank: int = 4,
                         scale: float = 2.0, keys: tuple[str, ...] = DEFAULT_KEYS) -> Path:
    """Write an adapter over every block of ``model`` (its ``layers``); same seed, same bytes."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = mx.random.key(seed)
    weights: dict[str, mx.array] = {}
    paths = {id(module): name for name, module in model.named_modules()}
    for block in model.layers:
        modules = dict(block.named_modules())
        for name in keys:
            in_dims, out_dims = linear_dims(modules[name])
            key, ka, kb = mx.random.split(key, 3)
            prefix = f"{paths[id(block)]}.{name}"
            weights[f"{prefix}.lora_a"] = mx.random.normal((in_dims, rank), key=ka) * in_dims**-0.5
            weights[f"{prefix}.lora_b"] = mx.random.normal((rank, out_dims), key=kb) * rank**-0.5
    mx.save_safetensors(str(out / WEIGHTS_FILE), weights)
    config = {"fine_tune_type": "lora", "num_layers": len(model.layers),
              "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0,
                                  "keys": list(keys)}}  # fmt: skip
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return out
