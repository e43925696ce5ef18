"""Draft checkpoints for the tests: the tiny model with noise on its weights (a draft
that agrees with it often, not always), and one whose tokenizer maps two tokens the
other way round (refused)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx


def noisy_copy(source: Path, out: Path, scale: float = 0.1, seed: int = 1) -> Path:
    """``source`` with Gaussian noise of ``scale`` times each tensor's own spread."""
    shutil.copytree(source, out)
    mx.random.seed(seed)
    for path in out.glob("*.safetensors"):
        weights = mx.load(str(path))
        noisy = {name: (w + scale * mx.std(w) * mx.random.normal(w.shape)).astype(w.dtype)
                 for name, w in weights.items()}
        mx.save_safetensors(str(path), noisy)
    return out


def swapped_tokenizer_copy(source: Path, out: Path) -> Path:
    """``source`` whose tokenizer gives two ordinary tokens each other's ids."""
    shutil.copytree(source, out)
    path = out / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(data))
    return out
