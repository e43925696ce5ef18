"""GGUF (llama.cpp) Llama checkpoints -> mlx-lm / Hugging Face layout.

Covers what the embedded SmolLM2 needs: the Llama architecture, block-quantized
weights as ``mx.load`` returns them (packed ``weight`` + ``scales`` + ``biases``),
and the gpt2-style BPE tokenizer stored in the GGUF metadata.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

# GGUF token types (llama.cpp `llama_token_type`).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    weights, meta = mx.load(str(path), return_metadata=True)
    return weights, meta


def _scalar(meta: dict[str, Any], key: str) -> Any:
    value = meta[key]
    return value.item() if isinstance(value, mx.array) else value


def llama_config(meta: dict[str, Any]) -> dict[str, Any]:
    """An HF-style ``config.json`` for mlx-lm's ``llama`` model."""
    if _scalar(meta, "general.architecture") != "llama":
        raise ValueError(f"unsupported GGUF architecture {meta['general.architecture']!r}")
    heads = int(_scalar(meta, "llama.attention.head_count"))
    hidden = int(_scalar(meta, "llama.embedding_length"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_scalar(meta, "llama.feed_forward_length")),
        "num_hidden_layers": int(_scalar(meta, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(meta, "llama.attention.head_count_kv")),
        "head_dim": hidden // heads,
        "rms_norm_eps": float(_scalar(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_scalar(meta, "llama.rope.freq_base")),
        "max_position_embeddings": int(_scalar(meta, "llama.context_length")),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id")),
        "tie_word_embeddings": True,  # flipped by convert_weights when `output` exists
        "torch_dtype": "float32",
    }


# llama.cpp quantizes in blocks of 32 weights; mx.load keeps them as MLX affine groups.
GGUF_BLOCK_SIZE = 32


def _dequantize(weights: dict[str, mx.array], stem: str) -> mx.array:
    w = weights[f"{stem}.weight"]
    if f"{stem}.scales" not in weights:
        return w.astype(mx.float32)
    # float32 scales/biases make the dequantized weights float32 (exact: they are fp16 values).
    scales = weights[f"{stem}.scales"].astype(mx.float32)
    biases = weights[f"{stem}.biases"].astype(mx.float32)
    bits = w.shape[-1] * 32 // (scales.shape[-1] * GGUF_BLOCK_SIZE)
    return mx.dequantize(w, scales, biases, group_size=GGUF_BLOCK_SIZE, bits=bits)


def _unpermute_rope(w: mx.array, n_heads: int) -> mx.array:
    # llama.cpp's converter interleaves q/k rows for its rope; undo it so mlx-lm's
    # (HF, rotate-half) rope sees the original layout.
    out_dims, in_dims = w.shape
    half = out_dims // n_heads // 2
    return w.reshape(n_heads, half, 2, in_dims).swapaxes(1, 2).reshape(out_dims, in_dims)


def _hf_name(stem: str) -> str:
    if stem in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[stem]
    _, layer, part = stem.split(".", 2)
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}"


def convert_weights(weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
    """Dequantize to float32, rename to HF names and undo the q/k rope permutation."""
    stems = sorted({name.rsplit(".", 1)[0] for name in weights})
    out: dict[str, mx.array] = {}
    for stem in stems:
        w = _dequantize(weights, stem)
        if stem.endswith(".attn_q"):
            w = _unpermute_rope(w, config["num_attention_heads"])
        elif stem.endswith(".attn_k"):
            w = _unpermute_rope(w, config["num_key_value_heads"])
        out[f"{_hf_name(stem)}.weight"] = w
    config["tie_word_embeddings"] = "lm_head.weight" not in out
    return out


def _special_tokens(meta: dict[str, Any]) -> list[str]:
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta["tokenizer.ggml.token_type"].tolist()
    special = (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    return [tok for tok, kind in zip(tokens, types, strict=True) if kind in special]


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` from the GGUF ``gpt2`` tokenizer metadata."""
    if meta["tokenizer.ggml.model"] != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer {meta['tokenizer.ggml.model']!r}")
    vocab = {tok: i for i, tok in enumerate(meta["tokenizer.ggml.tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    # llama.cpp's "smollm"/"starcoder" pre-tokenizer: single digits, then the gpt2 regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t in _special_tokens(meta)]
    tok.add_special_tokens(special)
    return tok


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """``tokenizer_config.json``: special tokens and the chat template from the GGUF."""
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        return tokens[int(_scalar(meta, key))] if key in meta else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "additional_special_tokens": _special_tokens(meta),
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token")),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta, "llama.context_length")),
        "chat_template": meta.get("tokenizer.chat_template"),
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    # Sorted keys and a fixed layout keep checkpoints byte-identical across runs.
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_tokenizer_files(meta: dict[str, Any], out_dir: Path) -> None:
    build_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    write_json(out_dir / "tokenizer_config.json", tokenizer_config(meta))
    special = tokenizer_config(meta)
    write_json(
        out_dir / "special_tokens_map.json",
        {k: special[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")},
    )
