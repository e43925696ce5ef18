"""An adapter on disk, in mlx-lm's format: ``adapter_config.json`` + ``adapters.safetensors``.

Only ``fine_tune_type = "lora"`` is served (DoRA and full fine-tunes change the base
weights themselves, which several adapters over one base cannot share). The digest
covers both files: the KV an adapter's prompt leaves depends on every byte of them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from mlxcel_plugin.errors import ConfigError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
DIGEST_CHARS = 16


@dataclass(frozen=True)
class LoraWeights:
    """One adapted linear layer: ``y += scale * (x @ a) @ b``."""

    a: mx.array  # (input_dims, rank)
    b: mx.array  # (rank, output_dims)


@dataclass(frozen=True)
class AdapterFiles:
    path: Path
    scale: float
    rank: int
    layers: dict[str, LoraWeights]  # module path ("model.layers.3.self_attn.q_proj") -> A, B
    digest: str


def adapter_digest(path: Path) -> str:
    sha = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        sha.update((path / name).read_bytes())
    return sha.hexdigest()[:DIGEST_CHARS]


def _config(path: Path) -> dict:
    try:
        config = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"adapter {path}: no readable {CONFIG_FILE} ({exc})") from exc
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise ConfigError(f"adapter {path}: fine_tune_type {kind!r} is not served (only lora)")
    params = config.get("lora_parameters") or {}
    if "scale" not in params or "rank" not in params:
        raise ConfigError(f"adapter {path}: lora_parameters needs rank and scale")
    return params


def _layers(path: Path) -> dict[str, LoraWeights]:
    try:
        weights = mx.load(str(path / WEIGHTS_FILE))
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"adapter {path}: no readable {WEIGHTS_FILE} ({exc})") from exc
    modules = {name.rsplit(".", 1)[0] for name in weights}
    layers = {}
    for module in sorted(modules):
        a, b = weights.get(f"{module}.lora_a"), weights.get(f"{module}.lora_b")
        if a is None or b is None:
            raise ConfigError(f"adapter {path}: {module} lacks lora_a or lora_b")
        layers[module] = LoraWeights(a, b)
    return layers


def read_adapter(path: str | Path) -> AdapterFiles:
    """The adapter at ``path``; ConfigError naming what is missing or unsupported."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"adapter {path}: not a directory")
    params = _config(path)
    return AdapterFiles(path, float(params["scale"]), int(params["rank"]), _layers(path),
                        adapter_digest(path))  # fmt: skip
