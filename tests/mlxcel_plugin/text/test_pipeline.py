from __future__ import annotations

import json

from mlxcel_plugin.engine_api import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, TokenEvent
from mlxcel_plugin.text import CompletionPipeline, StreamFilter, TextDelta, TextTokenizer
from mlxcel_plugin.text.pipeline import FINISH_TOOL_CALLS

EOS = 2


def events(ids: list[int], last_reason: str | None = FINISH_STOP) -> list[TokenEvent]:
    out = [TokenEvent("r", i, t) for i, t in enumerate(ids)]
    if last_reason is not None and out:
        out[-1] = TokenEvent("r", len(ids) - 1, ids[-1], last_reason)
    return out


def run(pipeline: CompletionPipeline, evs: list[TokenEvent]) -> TextDelta:
    total = TextDelta()
    for event in evs:
        delta = pipeline.feed(event)
        total.content += delta.content
        total.reasoning += delta.reasoning
        total.tool_calls += delta.tool_calls
        if pipeline.done:
            break
    return total


def ids_of(tok: TextTokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_eos_finishes_and_counts(text_tokenizer: TextTokenizer) -> None:
    p = CompletionPipeline(text_tokenizer, max_tokens=100)
    ids = ids_of(text_tokenizer, "Hello there") + [EOS]
    total = run(p, events(ids, None))
    assert (total.content, p.finish_reason, p.completion_tokens) == ("Hello there", "stop", 3)


def test_max_tokens_budget_is_owned_by_the_pipeline(text_tokenizer: TextTokenizer) -> None:
    ids = ids_of(text_tokenizer, "one two three four five")
    p = CompletionPipeline(text_tokenizer, max_tokens=2)
    total = run(p, events(ids, None))
    assert p.finish_reason == FINISH_LENGTH and p.completion_tokens == 2
    assert total.content == text_tokenizer.decode(ids[:2])


def test_stop_string_truncates_and_stops(text_tokenizer: TextTokenizer) -> None:
    ids = ids_of(text_tokenizer, "alpha beta STOP gamma")
    p = CompletionPipeline(text_tokenizer, max_tokens=100, stop=["STOP"])
    total = run(p, events(ids))
    assert total.content == "alpha beta "
    assert p.finish_reason == FINISH_STOP
    assert p.completion_tokens < len(ids)


def test_reasoning_split(text_tokenizer: TextTokenizer) -> None:
    ids = ids_of(text_tokenizer, "<think>Let me think.</think>The answer is 4.")
    p = CompletionPipeline(text_tokenizer, max_tokens=100, stream_filter=StreamFilter())
    total = run(p, events(ids))
    assert total.reasoning == "Let me think."
    assert total.content == "The answer is 4."


def test_tool_call_parsed_when_tools_requested(text_tokenizer: TextTokenizer) -> None:
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    text = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    p = CompletionPipeline(
        text_tokenizer, max_tokens=100, stream_filter=StreamFilter(), parse_tools=True
    )
    total = run(p, events(ids_of(text_tokenizer, text)))
    assert total.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in total.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert total.tool_calls[0].id.startswith("call_")
    assert p.finish_reason == FINISH_TOOL_CALLS


def test_tool_markup_without_tools_keeps_body_drops_markup(
    text_tokenizer: TextTokenizer,
) -> None:
    text = "ok <tool_call>not json</tool_call>"
    p = CompletionPipeline(text_tokenizer, max_tokens=100, stream_filter=StreamFilter())
    total = run(p, events(ids_of(text_tokenizer, text)))
    assert total.content == "ok not json"
    assert p.finish_reason == FINISH_STOP


def test_engine_error_is_reported(text_tokenizer: TextTokenizer) -> None:
    p = CompletionPipeline(text_tokenizer, max_tokens=100)
    p.feed(TokenEvent("r", 0, 100))
    p.feed(TokenEvent("r", 1, None, FINISH_ERROR, "boom"))
    assert p.finish_reason == FINISH_ERROR and p.error == "boom"


def test_streamed_equals_whole_for_every_split(text_tokenizer: TextTokenizer) -> None:
    # Same token stream, same deltas: nothing depends on timing.
    ids = ids_of(text_tokenizer, "<think>a 🦙</think>b END c")
    first = run(CompletionPipeline(text_tokenizer, max_tokens=50, stop=["END"],
                                   stream_filter=StreamFilter()), events(ids))  # fmt: skip
    assert (first.reasoning, first.content) == ("a 🦙", "b ")
