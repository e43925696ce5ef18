"""Load an mlx-lm checkpoint and describe it (``ModelInfo``) without a tokenizer object.

The engine speaks token ids, so only the EOS ids are read from the tokenizer
files; skipping ``transformers`` keeps engine start-up fast.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from engines.cache_layout import describe_model, dtype_name
from mlxcel_plugin.engine_api import ModelInfo
from mlxcel_plugin.errors import ConfigError

log = logging.getLogger(__name__)
DEFAULT_CONTEXT_LENGTH = 2048
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length")


def load_mlx_model(model_path: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} is not an mlx-lm checkpoint directory (no config.json)")
    return load_model(path)


def load_sharded_model(model_path: str | Path,
                       group: mx.distributed.Group) -> tuple[nn.Module, dict[str, Any]]:
    """This rank's tensor-parallel slice of a checkpoint (mlx-lm's ``model.shard``).

    Loaded lazily, so each rank reads only what its slice keeps.
    """
    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} is not an mlx-lm checkpoint directory (no config.json)")
    model, config = load_model(path, lazy=True)
    architecture = config.get("model_type", "?")
    if not hasattr(model, "shard"):
        raise ConfigError(f"mlx-lm has no tensor-parallel shard() for {architecture}")
    ranks = group.size()
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = _arg(config, key)
        if heads and int(heads) % ranks:
            raise ConfigError(f"{architecture}: {key}={heads} does not split over {ranks} ranks")
    model.shard(group)
    mx.eval(model.parameters())
    return model, config


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _token_id(tokenizer_json: dict[str, Any], token: Any) -> int | None:
    """Resolve a token string (or ``{"content": ...}``) through tokenizer.json."""
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    for added in tokenizer_json.get("added_tokens", []):
        if added.get("content") == token:
            return int(added["id"])
    vocab = tokenizer_json.get("model", {}).get("vocab", {})
    return int(vocab[token]) if isinstance(vocab, dict) and token in vocab else None


def eos_token_ids(model_path: Path, config: dict[str, Any]) -> tuple[int, ...]:
    """EOS ids from config.json, generation_config.json and the tokenizer's eos_token."""
    ids = _as_ids(config.get("eos_token_id"))
    ids += _as_ids(_read_json(model_path / "generation_config.json").get("eos_token_id"))
    eos = _read_json(model_path / "tokenizer_config.json").get("eos_token")
    tok_id = _token_id(_read_json(model_path / "tokenizer.json"), eos)
    if tok_id is not None:
        ids.append(tok_id)
    return tuple(sorted(set(ids)))


def context_length(config: dict[str, Any]) -> int:
    text_config = config.get("text_config", {})
    for key in _CONTEXT_KEYS:
        value = config.get(key, text_config.get(key))
        if value:
            return int(value)
    return DEFAULT_CONTEXT_LENGTH


def activation_dtype(model: nn.Module) -> mx.Dtype:
    """The most common floating dtype among the parameters: what K/V are computed in."""
    params = tree_flatten(model.parameters())
    floats = [v.dtype for _, v in params if mx.issubdtype(v.dtype, mx.floating)]
    return Counter(floats).most_common(1)[0][0] if floats else mx.float32


def _arg(config: dict[str, Any], key: str) -> Any:
    return config.get(key, config.get("text_config", {}).get(key))


def cache_fingerprint(model: nn.Module, architecture: str) -> dict[str, Any]:
    """The fingerprint, from the model's own caches after a probe prefill (no config keys).

    ``layers`` describes each handoff layer (mlxcel_plugin/kv_serde/layer_spec.py); a
    kind that cannot travel is listed by class with no arrays (refused per request).
    ``kv_heads``/``head_dim`` are set for uniform K/V models only (older peers read them).
    """
    specs = describe_model(model)
    stuck = sorted({spec.kind for spec in specs if not spec.arrays})
    if stuck:  # the node serves hybrid requests; prefills for a handoff are refused by name
        log.warning("%s cannot run disaggregated: cache classes %s cannot be handed off",
                    architecture, stuck)
    kv_heads = head_dim = 0
    shapes = {a.shape for spec in specs for a in spec.arrays}
    uniform = all(spec.names == ("k", "v") for spec in specs) and len(shapes) == 1
    if uniform:
        _, kv_heads, _, head_dim = next(iter(shapes))
    return {
        "architecture": architecture,
        "num_layers": len(specs),
        "kv_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "dtype": dtype_name(activation_dtype(model)),
        "cache_classes": [spec.kind for spec in specs],
        "layers": [spec.to_dict() for spec in specs],
    }


def model_info(model_path: str | Path, model: nn.Module, config: dict[str, Any]) -> ModelInfo:
    path = Path(model_path)
    architecture = config.get("model_type", type(model).__module__.rsplit(".", 1)[-1])
    vocab = _arg(config, "vocab_size")
    return ModelInfo(
        model_id=path.name,
        fingerprint=cache_fingerprint(model, architecture),
        context_length=context_length(config),
        eos_token_ids=eos_token_ids(path, config),
        vocab_size=int(vocab) if vocab else 0,
        tokenizer_dir=str(path),
    )
