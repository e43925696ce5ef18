"""Checkpoints: the tiny model is reproducible; conversions load in mlx-lm and transformers."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engines import gguf, model_store


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_tiny_checkpoint_is_byte_identical_per_seed(tmp_path, tiny_model_path):
    again = model_store.write_tiny_checkpoint(tmp_path / "again", seed=0)
    assert _files(again) == _files(tiny_model_path)
    other = model_store.write_tiny_checkpoint(tmp_path / "other", seed=1)
    assert _files(other)["model.safetensors"] != _files(again)["model.safetensors"]


def test_ensure_is_idempotent(tmp_path):
    first = model_store.ensure_tiny_model(root=tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert model_store.ensure_tiny_model(root=tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp dirs left


def test_tiny_checkpoint_has_an_untied_head(tiny_model_path):
    weights = mx.load(str(tiny_model_path / "model.safetensors"))
    assert "lm_head.weight" in weights
    assert all(w.dtype == mx.float32 for w in weights.values())


def test_rope_unpermute_inverts_llama_cpp_permute():
    heads, head_dim, dim = 3, 8, 5
    w = mx.arange(heads * head_dim * dim, dtype=mx.float32).reshape(heads * head_dim, dim)
    # llama.cpp convert_hf_to_gguf.py `permute`.
    permuted = w.reshape(heads, 2, head_dim // 2, dim).swapaxes(1, 2).reshape(w.shape)
    assert mx.array_equal(gguf._unpermute_rope(permuted, heads), w).item()


def test_tokenizer_loads_with_transformers_and_applies_the_chat_template(tiny_model_path):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_model_path))
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Hi 42"}], add_generation_prompt=True, tokenize=False
    )
    assert ids.startswith("<|im_start|>system\n") and ids.endswith("<|im_start|>assistant\n")
    encoded = tok.encode("<|im_start|>user\nHi 42<|im_end|>")
    assert encoded[0] == 1 and encoded[-1] == 2
    assert tok.decode(encoded) == "<|im_start|>user\nHi 42<|im_end|>"
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
