"""Tokenizer wrapper: the only place the text pipeline touches ``transformers``.

Loads the fast tokenizer shipped in a checkpoint directory, so the router can
template, tokenize and detokenize without model weights.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError

from mlxcel_plugin.errors import ConfigError, InvalidRequestError
from mlxcel_plugin.text.chat_turns import TemplateSupport, template_messages
from mlxcel_plugin.text.tool_parsers import template_of, tool_parser_for

log = logging.getLogger(__name__)

# Config keys that name the context window, most specific first.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
# Special tokens some models use to open a tool call (kept through detokenization).
KNOWN_TOOL_TOKENS = ("<|python_tag|>", "[TOOL_CALLS]")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _as_ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _unique(ids: Iterable[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))


class TextTokenizer:
    """Chat template, encode/decode and special ids of one checkpoint."""

    def __init__(
        self, hf_tokenizer: Any, *, eos_token_ids: Sequence[int], context_length: int | None
    ):
        self.hf = hf_tokenizer
        self.eos_token_ids = _unique(eos_token_ids)
        self.context_length = context_length
        self.special_ids = frozenset(hf_tokenizer.all_special_ids)
        self.vocab_size = len(hf_tokenizer)
        # get_vocab() copies the whole vocabulary: look the tool tokens up once.
        vocab = hf_tokenizer.get_vocab()
        self.tool_parser = tool_parser_for(hf_tokenizer)  # mlx-lm's for its families, else ours
        markup = (*KNOWN_TOOL_TOKENS, self.tool_parser.start, self.tool_parser.end)
        self._tool_tokens = {vocab[t]: t for t in markup if t and t in vocab}
        # The stream filter's markers: the parser's pair, ours, lone tool tokens.
        self.filter_markers = self.tool_parser.markers(
            tuple(t for t in KNOWN_TOOL_TOKENS if t in vocab))
        self.template_support = TemplateSupport.of(template_of(hf_tokenizer))
        self._reported_ignored_tools = False
        self._decode_ids = _fast_decoder(hf_tokenizer)
        self._encode_text = _fast_encoder(hf_tokenizer)
        self._encode_text_in_thread = _gil_free_encoder(hf_tokenizer, self._encode_text)
        # A token's text is at most this long, so a text of n characters is at least
        # n / max_token_bytes tokens (with no normalizer: it could shrink the text).
        self.max_token_bytes = max((len(t.encode()) for t in vocab), default=1)
        self._bounded = _decodes_by_concatenation(hf_tokenizer)
        self._pieces: dict[int, str | None] | None = {} if _decodes_by_concatenation(
            hf_tokenizer) else None

    @classmethod
    def from_dir(cls, path: str | Path) -> TextTokenizer:
        # Imported here so importing the text package stays cheap. The router has
        # no PyTorch on purpose: silence transformers' advisory about it.
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer

        path = Path(path)
        try:
            hf = AutoTokenizer.from_pretrained(str(path), use_fast=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load a tokenizer from {path}: {exc}") from exc
        config = _read_json(path / "config.json")
        generation = _read_json(path / "generation_config.json")
        eos = _as_ids(hf.eos_token_id) + _as_ids(config.get("eos_token_id"))
        eos += _as_ids(generation.get("eos_token_id"))
        return cls(hf, eos_token_ids=eos, context_length=_context_length(config))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._encode_text(text, add_special_tokens)

    def encode_in_thread(
        self, text: str, *, add_special_tokens: bool = True, max_tokens: int | None = None
    ) -> list[int] | int:
        """``encode``, releasing the GIL meanwhile: for big texts, from a worker thread.

        ``tokenizers`` holds the GIL in a single ``encode`` (a 10 MB text froze every
        other thread for 19 s); its batch call releases it and gives the same ids.
        With ``max_tokens``, a text of that many tokens or more gives its token count
        instead (an int): the caller refuses it, and no list of millions of ids is
        built while holding the GIL.
        """
        return self._encode_text_in_thread(text, add_special_tokens, max_tokens)

    def tokens_at_least(self, text_chars: int) -> int:
        """A lower bound on the tokens of any text of ``text_chars`` characters (0: none known).

        A character is at least one byte, a token at most ``max_token_bytes``; true
        for a byte-level vocabulary without a normalizer, the only kind it is given for.
        """
        return text_chars // self.max_token_bytes if self._bounded else 0

    def decode(self, ids: Sequence[int]) -> str:
        # No space clean-up: streamed pieces must concatenate to exactly this.
        return self._decode_ids(list(ids))

    def piece(self, token_id: int) -> str | None:
        """What ``token_id`` adds to any decode that ends in complete text, or None.

        None when this tokenizer's decode is not plain concatenation (e.g. a
        SentencePiece decoder drops the leading space of the first token) or the
        token is part of a character (its bytes alone are not valid UTF-8). The
        streaming detokenizer then decodes a window instead.
        """
        pieces = self._pieces
        if pieces is None:
            return None
        try:
            return pieces[token_id]
        except KeyError:
            text = self._decode_ids([token_id])
            pieces[token_id] = text = None if "\ufffd" in text else text
            return text

    def token_text(self, token_id: int) -> str:
        """The literal text of one token, special or not."""
        return self.hf.convert_tokens_to_string([self.hf.convert_ids_to_tokens(token_id)])

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for ``messages``, ending with the assistant generation prompt."""
        if tools and not self.template_support.tools and not self._reported_ignored_tools:
            self._reported_ignored_tools = True  # once: every tool request would say it again
            log.warning("the chat template ignores 'tools': the model is not told about them")
        try:
            text = self.hf.apply_chat_template(
                template_messages(messages, self.template_support),
                tools=tools,
                add_generation_prompt=True,
                tokenize=False,
                **dict(template_kwargs or {}),
            )
        except (TemplateError, ValueError, TypeError) as exc:
            message = f"cannot apply the chat template: {exc}"
            raise InvalidRequestError(message, param="messages") from exc
        return text if isinstance(text, str) else str(text)

    def encode_chat(self, prompt_text: str) -> list[int]:
        # The template already wrote BOS and role markers as text.
        return self.encode(prompt_text, add_special_tokens=False)

    def tool_token_ids(self) -> dict[int, str]:
        """Special tokens this vocabulary uses to open tool calls, by id."""
        return dict(self._tool_tokens)


def _fast_decoder(hf: Any) -> Callable[[list[int]], str]:
    """Decode without clean-up, skipping special tokens (called twice per streamed token).

    A ``tokenizers``-backed tokenizer that keeps the stock ``_decode`` does exactly
    ``backend_tokenizer.decode``: call it directly, without the wrapper's overhead.
    """
    from transformers import PreTrainedTokenizerFast

    backend = getattr(hf, "backend_tokenizer", None)
    stock = getattr(type(hf), "_decode", None) is PreTrainedTokenizerFast._decode
    if backend is not None and stock:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: hf.decode(ids, skip_special_tokens=True,
                                 clean_up_tokenization_spaces=False)


def _decodes_by_concatenation(hf: Any) -> bool:
    """Byte-level BPE (GPT-2, Llama 3, SmolLM): decode(a + b) == decode(a) + decode(b)
    whenever both halves decode to whole characters; the decoder only maps tokens to
    bytes. Other decoders (Metaspace, WordPiece) depend on the neighbouring tokens."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or getattr(backend, "normalizer", None) is not None:
        return False
    from tokenizers import decoders

    return isinstance(backend.decoder, decoders.ByteLevel)


def _fast_encoder(hf: Any) -> Callable[[str, bool], list[int]]:
    """Encode one text, calling the ``tokenizers`` backend directly when that is exact.

    The stock wrapper encodes a batch of one (rayon threads: a costly hop on a
    router pinned to one core) after re-checking truncation and padding. With
    neither configured on the backend and special tokens kept whole, the single
    ``encode`` yields the same ids.
    """

    def stock(text: str, add_special_tokens: bool) -> list[int]:
        return list(hf.encode(text, add_special_tokens=add_special_tokens))

    backend = getattr(hf, "backend_tokenizer", None)
    base = _stock_backend_class()
    if backend is None or base is None or type(hf)._encode_plus is not base._encode_plus:
        return stock

    def direct(text: str, add_special_tokens: bool) -> list[int]:
        if (backend.truncation is not None or backend.padding is not None
                or backend.encode_special_tokens or hf.split_special_tokens):
            return stock(text, add_special_tokens)
        return backend.encode(text, add_special_tokens=add_special_tokens).ids

    return direct


def _capped(ids: list[int], max_tokens: int | None) -> list[int] | int:
    return len(ids) if max_tokens is not None and len(ids) >= max_tokens else ids


def _gil_free_encoder(
    hf: Any, encode: Callable[[str, bool], list[int]]
) -> Callable[[str, bool, int | None], list[int] | int]:
    """The backend's batch encode of one text (it releases the GIL), where that is exact."""
    backend = getattr(hf, "backend_tokenizer", None)
    base = _stock_backend_class()
    if backend is None or base is None or type(hf)._encode_plus is not base._encode_plus:
        return lambda text, special, max_tokens: _capped(encode(text, special), max_tokens)

    def batch_of_one(text: str, special: bool, max_tokens: int | None) -> list[int] | int:
        if (backend.truncation is not None or backend.padding is not None
                or backend.encode_special_tokens or hf.split_special_tokens):
            return _capped(encode(text, special), max_tokens)
        encoding = backend.encode_batch([text], add_special_tokens=special)[0]
        if max_tokens is not None and len(encoding) >= max_tokens:
            return len(encoding)
        return encoding.ids

    return batch_of_one


def _stock_backend_class() -> Any:
    """transformers' ``tokenizers``-backed tokenizer class, under either major's name."""
    import transformers

    return getattr(transformers, "TokenizersBackend", None) or getattr(
        transformers, "PreTrainedTokenizerFast", None)


def _context_length(config: Mapping[str, Any]) -> int | None:
    for key in _CONTEXT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None
