"""Tiny random checkpoints of many mlx-lm architectures, for the architecture matrix.

Each is built offline from mlx-lm's own model class (hidden 64, at most 4
layers, SmolLM2's tokenizer and vocabulary), once per (architecture, seed),
into ``MLXCEL_CACHE_DIR``. The output head is scaled up so greedy tokens are
far from ties (a cache lost or garbled in a handoff then shows in the text).
``python -m engines.tiny_models ARCH [OUT_DIR]``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map
from mlx_lm.utils import _get_classes

from engines import gguf
from engines.model_store import _ensure, _save_weights, _write_generation_config, smollm2_gguf_path

BODY: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}
_MLA = {"kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "num_key_value_heads": 4, "moe_intermediate_size": 32}
_YARN = {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 2048,
         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
_SSM = {"state_size": 8, "conv_kernel": 4, "expand": 2, "time_step_rank": 8, "use_bias": False,
        "use_conv_bias": True}
# model_type -> what it needs on top of BODY (a window shorter than the matrix's prompts).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3": {},
    # mlx-lm serves mistral with its llama class, which wants one full-attention layer.
    "mistral": {"sliding_window": 32,
                "layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
    "gemma3_text": {"sliding_window": 32, "sliding_window_pattern": 2,
                    "query_pre_attn_scalar": 16, "num_hidden_layers": 4},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 32,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "rope_scaling": None, "swiglu_limit": 7.0},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v2": {**_MLA, "q_lora_rank": None, "n_routed_experts": None,
                    "first_k_dense_replace": 0, "rope_scaling": _YARN},
    "deepseek_v3": {**_MLA, "q_lora_rank": 32, "n_routed_experts": 4, "n_shared_experts": 1,
                    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1,
                    "topk_group": 1, "moe_layer_freq": 1, "routed_scaling_factor": 1.0,
                    "rope_scaling": None},
    "minicpm3": {**_MLA, "q_lora_rank": 32, "scale_emb": 1.0, "scale_depth": 1.0,
                 "dim_model_base": 64, "rope_scaling": {
                     "type": "longrope", "original_max_position_embeddings": 2048,
                     "short_factor": [1.0] * 4, "long_factor": [1.0] * 4}},
    "mamba": {**_SSM, "d_model": 64, "n_layer": 4},
    "mamba2": {**_SSM, "num_heads": 8, "head_dim": 16, "n_groups": 1, "chunk_size": 32,
               "layer_norm_epsilon": 1e-5, "residual_in_fp32": True, "time_step_min": 0.001,
               "time_step_max": 0.1, "time_step_floor": 1e-4,
               "time_step_limit": [0.0, 1e9]},
    "qwen3_next": {"linear_num_value_heads": 4, "linear_num_key_heads": 2,
                   "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                   "linear_conv_kernel_dim": 4, "full_attention_interval": 2, "num_experts": 4,
                   "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                   "shared_expert_intermediate_size": 64, "moe_intermediate_size": 32,
                   "mlp_only_layers": [], "partial_rotary_factor": 0.25,
                   "norm_topk_prob": True},
    "lfm2": {"block_dim": 64, "block_ff_dim": 128, "conv_L_cache": 3, "conv_bias": False,
             "layer_types": ["conv", "full_attention"] * 2, "full_attn_idxs": [1, 3],
             "block_multiple_of": 32, "block_ffn_dim_multiplier": 1.0,
             "block_auto_adjust_ff_dim": False, "norm_eps": 1e-5},
    "nemotron_h": {"hybrid_override_pattern": "M*-M", "mamba_num_heads": 8,
                   "mamba_head_dim": 16, "mamba_hidden_act": "silu", "ssm_state_size": 8,
                   "conv_kernel": 4, "n_groups": 1, "mlp_hidden_act": "relu2",
                   "attention_bias": False, "mamba_proj_bias": False, "use_conv_bias": True,
                   "layer_norm_epsilon": 1e-5, "chunk_size": 32, "mlp_bias": False,
                   "use_bias": False, "time_step_limit": [0.0, 1e9],
                   "residual_in_fp32": False},
}
HEAD_SCALE = 4.0  # logits std of a few units: greedy tokens stay clear of ties
SSM_DT_BIAS = -5.0  # softplus(-5) ~ 0.007: a random SSM otherwise forgets in a few tokens
TINY_ARCH_DIR = "tiny-arch-{arch}{quant}-seed{seed}"  # never model_store.TINY_DIR's name


def tiny_config(arch: str, tokenizer_config: dict[str, Any]) -> dict[str, Any]:
    extra = ARCHITECTURES[arch]
    return {**tokenizer_config, **BODY, "model_type": arch, **extra}


def _long_memory(weights: dict[str, mx.array]) -> None:
    """SSM time steps near 0: state decays slowly, so the prompt's head still shows at its end."""
    for name in [n for n in weights if n.endswith(("dt_proj.bias", "dt_bias"))]:
        weights[name] = mx.full(weights[name].shape, SSM_DT_BIAS, dtype=weights[name].dtype)


def _scale_head(weights: dict[str, mx.array]) -> None:
    head = "lm_head.weight" if "lm_head.weight" in weights else None
    if head is None:  # tied: scale the embedding (a norm follows it in these models)
        head = next(name for name in weights if name.endswith("embed_tokens.weight")
                    or name.endswith("embeddings.weight"))
    weights[head] = weights[head] * HEAD_SCALE


def write_arch_checkpoint(out_dir: Path, arch: str, seed: int = 0, q_bits: int = 0,
                          head_dim: int = 0) -> Path:
    """A random ``arch`` on SmolLM2's tokenizer; ``q_bits``: weights quantized (like convert -q).

    ``head_dim``: another attention head width (kv_bits needs a multiple of 32).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _, meta = gguf.read_gguf(smollm2_gguf_path())
    config = tiny_config(arch, gguf.llama_config(meta))
    config |= {"head_dim": head_dim} if head_dim else {}
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    _scale_head(weights)
    _long_memory(weights)
    model.load_weights(list(weights.items()))
    if q_bits:
        nn.quantize(model, group_size=32, bits=q_bits)
        config["quantization"] = {"group_size": 32, "bits": q_bits}
    mx.eval(model.parameters())
    _save_weights(out_dir, dict(tree_flatten(tree_map(lambda x: x, model.parameters()))))
    gguf.write_json(out_dir / "config.json", config)
    _write_generation_config(out_dir, config)
    gguf.write_tokenizer_files(meta, out_dir)
    return out_dir


def ensure_arch_model(arch: str, seed: int = 0, root: Path | None = None, q_bits: int = 0,
                      head_dim: int = 0) -> Path:
    variant = (f"-q{q_bits}" if q_bits else "") + (f"-hd{head_dim}" if head_dim else "")
    name = TINY_ARCH_DIR.format(arch=arch, quant=variant, seed=seed)
    return _ensure(name, lambda out: write_arch_checkpoint(out, arch, seed, q_bits, head_dim),
                   root)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in ARCHITECTURES or len(args) > 2:
        print(f"usage: python -m engines.tiny_models {'|'.join(ARCHITECTURES)} [OUT_DIR]",
              file=sys.stderr)
        return 2
    out = Path(args[1]) if len(args) == 2 else None
    path = write_arch_checkpoint(out, args[0]) if out else ensure_arch_model(args[0])
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
