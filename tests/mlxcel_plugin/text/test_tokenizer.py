from __future__ import annotations

import pytest

from mlxcel_plugin.errors import ConfigError, InvalidRequestError
from mlxcel_plugin.text import TextTokenizer


def test_loads_special_ids_and_context(text_tokenizer: TextTokenizer) -> None:
    assert text_tokenizer.eos_token_ids == (2,)
    assert text_tokenizer.context_length == 2048
    assert text_tokenizer.vocab_size == 49152
    assert 2 in text_tokenizer.special_ids


def test_chat_template_renders_generation_prompt(text_tokenizer: TextTokenizer) -> None:
    text = text_tokenizer.render_chat([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>assistant\n")
    ids = text_tokenizer.encode_chat(text)
    assert ids[0] == 1 and text_tokenizer.hf.decode(ids) == text


def test_template_refusal_is_a_400(tokenizer_dir: str) -> None:
    tok = TextTokenizer.from_dir(tokenizer_dir)
    tok.hf.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        tok.render_chat([{"role": "user", "content": "x"}])


def test_missing_dir_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError):
        TextTokenizer.from_dir(tmp_path / "nope")
