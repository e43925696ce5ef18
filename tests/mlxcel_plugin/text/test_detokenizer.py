from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mlxcel_plugin.text import IncrementalDetokenizer, TextTokenizer


def stream(tok: TextTokenizer, ids: list[int], kept: dict[int, str] | None = None,
           *, pieces: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok.decode, kept, tok.piece if pieces else None)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    return pieces


def test_multibyte_character_is_held_until_complete(text_tokenizer: TextTokenizer) -> None:
    ids = text_tokenizer.encode("a 🦙 b", add_special_tokens=False)
    pieces = stream(text_tokenizer, ids)
    assert "".join(pieces) == "a 🦙 b"
    assert all("\ufffd" not in p for p in pieces)
    assert " 🦙" in pieces  # emitted whole, once its last byte token arrived


def test_matches_full_decode_on_text(text_tokenizer: TextTokenizer) -> None:
    text = "Héllo, wörld! 日本語 — <think>x</think>\n\n  spaces  and tabs\tend."
    ids = text_tokenizer.encode(text, add_special_tokens=False)
    assert "".join(stream(text_tokenizer, ids)) == text_tokenizer.decode(ids) == text


def test_special_tokens_are_skipped_like_full_decode(text_tokenizer: TextTokenizer) -> None:
    ids = text_tokenizer.encode("hi", add_special_tokens=False) + [2, 1]
    ids += text_tokenizer.encode(" there", add_special_tokens=False)
    assert "".join(stream(text_tokenizer, ids)) == "hi there"


def test_kept_special_token_passes_through(text_tokenizer: TextTokenizer) -> None:
    ids = text_tokenizer.encode("a", add_special_tokens=False) + [2]
    ids += text_tokenizer.encode("b", add_special_tokens=False)
    assert "".join(stream(text_tokenizer, ids, {2: "<END>"})) == "a<END>b"


def test_invalid_bytes_flush_as_replacement_like_full_decode(
    text_tokenizer: TextTokenizer,
) -> None:
    emoji = text_tokenizer.encode(" 🦙", add_special_tokens=False)
    ids = emoji[:2]  # cut mid-character
    pieces = stream(text_tokenizer, ids)
    assert pieces[:-1] == ["", ""]
    assert "".join(pieces) == text_tokenizer.decode(ids)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=49151), max_size=40))
def test_random_ids_concatenate_to_full_decode(text_tokenizer: TextTokenizer, ids: list[int]):
    # Random ids include special tokens and bytes that split UTF-8 sequences.
    assert "".join(stream(text_tokenizer, ids)) == text_tokenizer.decode(ids)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=49151), max_size=40))
def test_piece_lookup_gives_the_same_deltas_as_window_decoding(
    text_tokenizer: TextTokenizer, ids: list[int]
):
    assert stream(text_tokenizer, ids) == stream(text_tokenizer, ids, pieces=False)


def test_same_deltas_on_text_with_split_characters(text_tokenizer: TextTokenizer) -> None:
    ids = text_tokenizer.encode("a 🦙 b 日本語 ok", add_special_tokens=False)
    assert stream(text_tokenizer, ids) == stream(text_tokenizer, ids, pieces=False)


def test_a_piece_is_none_for_part_of_a_character(text_tokenizer: TextTokenizer) -> None:
    emoji = text_tokenizer.encode(" 🦙", add_special_tokens=False)
    assert len(emoji) > 1 and text_tokenizer.piece(emoji[0]) is None
    (word,) = text_tokenizer.encode(" the", add_special_tokens=False)
    assert text_tokenizer.piece(word) == " the"
