from __future__ import annotations

from mlxcel_plugin.text import FilterMarkers, Piece, StreamFilter, prompt_opens_reasoning
from mlxcel_plugin.text.stream_filter import CONTENT, REASONING, TOOL_CALL, TOOL_CALL_END


def run(pieces: list[str], **kwargs) -> list[Piece]:
    f = StreamFilter(**kwargs)
    out: list[Piece] = []
    for piece in pieces:
        out += f.feed(piece)
    return merge(out + f.flush())


def merge(pieces: list[Piece]) -> list[Piece]:
    merged: list[Piece] = []
    for p in pieces:
        if merged and merged[-1].kind == p.kind and p.kind != TOOL_CALL_END:
            merged[-1] = Piece(p.kind, merged[-1].text + p.text)
        else:
            merged.append(p)
    return merged


def test_plain_text_is_content() -> None:
    assert run(["hello ", "world"]) == [Piece(CONTENT, "hello world")]


def test_think_block_becomes_reasoning() -> None:
    got = run(["<think>plan</think>answer"])
    assert got == [Piece(REASONING, "plan"), Piece(CONTENT, "answer")]


def test_markers_split_char_by_char() -> None:
    text = "<think>a</think>b<tool_call>{}</tool_call>c"
    got = run(list(text))
    assert got == [
        Piece(REASONING, "a"),
        Piece(CONTENT, "b"),
        Piece(TOOL_CALL, "{}"),
        Piece(TOOL_CALL_END),
        Piece(CONTENT, "c"),
    ]


def test_partial_marker_held_then_released_as_text() -> None:
    f = StreamFilter()
    assert f.feed("a <thi") == [Piece(CONTENT, "a ")]
    assert f.feed("s") == [Piece(CONTENT, "<this")]


def test_partial_marker_at_end_is_text() -> None:
    assert run(["x</thi"]) == [Piece(CONTENT, "x</thi")]


def test_generation_starting_inside_think() -> None:
    got = run(["plan</think>answer"], start_in_reasoning=True)
    assert got == [Piece(REASONING, "plan"), Piece(CONTENT, "answer")]


def test_stray_close_marker_never_reaches_content() -> None:
    assert run(["a</think>b"]) == [Piece(CONTENT, "ab")]


def test_unclosed_tool_call_ends_at_flush() -> None:
    assert run(["<tool_call>{"]) == [Piece(TOOL_CALL, "{"), Piece(TOOL_CALL_END)]


def test_tool_markup_inside_reasoning_is_reasoning_text() -> None:
    got = run(["<think>use <tool_call> maybe</think>ok"])
    assert got == [Piece(REASONING, "use <tool_call> maybe"), Piece(CONTENT, "ok")]


def test_model_tool_token_runs_to_end() -> None:
    markers = FilterMarkers().with_tool_openers(["[TOOL_CALLS]"])
    got = run(["hi[TOOL_", "CALLS][{}]"], markers=markers)
    assert got == [Piece(CONTENT, "hi"), Piece(TOOL_CALL, "[{}]"), Piece(TOOL_CALL_END)]


def test_prompt_opens_reasoning() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<think>x</think> assistant\n")
    assert not prompt_opens_reasoning("assistant\n")
