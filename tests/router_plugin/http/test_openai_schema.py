from __future__ import annotations

import pytest

from mlxcel_plugin.engine_api import SamplingParams
from mlxcel_plugin.errors import InvalidRequestError
from router_plugin.http.openai_schema import parse_chat_request, parse_completion_request

USER = [{"role": "user", "content": "hi"}]


def bad(param: str, body: dict, parse=parse_chat_request) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse(body)
    assert info.value.param == param
    assert info.value.to_openai()["error"]["type"] == "invalid_request_error"


def test_minimal_chat_defaults() -> None:
    params = parse_chat_request({"messages": USER})
    assert params.common.model is None and params.common.max_tokens is None
    assert params.common.sampling == SamplingParams()
    assert params.common.stop == () and not params.common.stream
    assert params.messages == [{"role": "user", "content": "hi"}]


def test_sampling_params_pass_through() -> None:
    body = {
        "messages": USER, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
        "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "seed": 42,
    }  # fmt: skip
    assert parse_chat_request(body).common.sampling == SamplingParams(
        0.7, 0.9, 40, 0.05, 1.1, 0.5, -0.5, 42
    )


def test_top_k_minus_one_means_disabled() -> None:
    assert parse_chat_request({"messages": USER, "top_k": -1}).common.sampling.top_k == 0


def test_max_completion_tokens_wins() -> None:
    body = {"messages": USER, "max_tokens": 5, "max_completion_tokens": 7}
    assert parse_chat_request(body).common.max_tokens == 7


def test_stop_string_or_list() -> None:
    assert parse_chat_request({"messages": USER, "stop": "x"}).common.stop == ("x",)
    assert parse_chat_request({"messages": USER, "stop": ["a", "", "b"]}).common.stop == (
        "a",
        "b",
    )


def test_include_usage_only_when_streaming() -> None:
    opts = {"include_usage": True}
    assert parse_chat_request(
        {"messages": USER, "stream": True, "stream_options": opts}
    ).common.include_usage
    # As OpenAI: stream_options without stream is a 400, not silently ignored.
    bad("stream_options", {"messages": USER, "stream_options": opts})
    bad("stream_options", {"messages": USER, "stream": False, "stream_options": opts})


def test_text_parts_flattened_and_developer_is_system() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    params = parse_chat_request({"messages": [{"role": "developer", "content": parts}]})
    assert params.messages == [{"role": "system", "content": "ab"}]


def test_assistant_tool_call_arguments_become_mappings() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [call]}]
    params = parse_chat_request({"messages": messages})
    assert params.messages[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}


def test_tool_choice_none_drops_tools() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert parse_chat_request({"messages": USER, "tools": tools}).tools == tools
    assert (
        parse_chat_request({"messages": USER, "tools": tools, "tool_choice": "none"}).tools is None
    )


@pytest.mark.parametrize(
    ("param", "extra"),
    [
        ("messages", {"messages": None}),
        ("messages", {"messages": []}),
        ("messages", {"messages": "hi"}),
        ("messages[0]", {"messages": ["hi"]}),
        ("messages[0].role", {"messages": [{"role": "wizard", "content": "x"}]}),
        ("messages[0].content", {"messages": [{"role": "user"}]}),
        ("messages[0].content", {"messages": [{"role": "user", "content": 5}]}),
        ("messages[0].content",
         {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
        ("max_tokens", {"max_tokens": 0}),
        ("max_tokens", {"max_tokens": -3}),
        ("max_tokens", {"max_tokens": 1.5}),
        ("max_tokens", {"max_tokens": "5"}),
        ("max_tokens", {"max_tokens": True}),
        ("max_completion_tokens", {"max_completion_tokens": 0}),
        ("temperature", {"temperature": "hot"}),
        ("temperature", {"temperature": 3}),
        ("top_p", {"top_p": 0}),
        ("top_k", {"top_k": 1.5}),
        ("seed", {"seed": "x"}),
        ("stop", {"stop": 5}),
        ("stop", {"stop": ["a", 1]}),
        ("stream", {"stream": "yes"}),
        ("stream_options", {"stream": True, "stream_options": 1}),
        ("n", {"n": 2}),
        ("n", {"n": 0}),
        ("logprobs", {"logprobs": 1}),
        ("top_logprobs", {"logprobs": True, "top_logprobs": 21}),
        ("top_logprobs", {"top_logprobs": 1}),
        ("response_format", {"response_format": {"type": "yaml"}}),
        ("response_format", {"response_format": {"type": "json_schema", "json_schema": {}}}),
        ("response_format", {"response_format": "json"}),
        ("model", {"model": 3}),
        ("tools", {"tools": [{"type": "function"}]}),
        ("tool_choice", {"tools": [{"type": "function", "function": {"name": "f"}}],
                         "tool_choice": "sometimes"}),
        ("tool_choice", {"tools": [{"type": "function", "function": {"name": "f"}}],
                         "tool_choice": {"type": "function", "function": {"name": "g"}}}),
        ("tool_choice", {"tool_choice": "required"}),
        ("chat_template_kwargs", {"chat_template_kwargs": [1]}),
    ],
)  # fmt: skip
def test_bad_chat_fields(param: str, extra: dict) -> None:
    bad(param, {"messages": USER, **extra})


def test_a_forced_tool_choice_names_the_tools_to_call() -> None:
    tools = [{"type": "function", "function": {"name": n}} for n in ("f", "g")]
    required = parse_chat_request({"messages": USER, "tools": tools, "tool_choice": "required"})
    assert required.forced_tools == ("f", "g")
    named = {"type": "function", "function": {"name": "g"}}
    assert parse_chat_request({"messages": USER, "tools": tools,
                               "tool_choice": named}).forced_tools == ("g",)  # fmt: skip
    assert parse_chat_request({"messages": USER, "tools": tools}).forced_tools is None


def test_response_format_text_is_fine() -> None:
    parse_chat_request({"messages": USER, "response_format": {"type": "text"}})


def test_response_format_json_becomes_the_grammar_spec() -> None:
    # mlxcel_plugin/structured_output.py parses it (tests/mlxcel_plugin/test_structured_output.py)
    plain = parse_chat_request({"messages": USER})
    assert plain.common.sampling.grammar is None
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    chat = parse_chat_request({"messages": USER, "response_format": fmt})
    assert '"json_schema"' in chat.common.sampling.grammar
    completion = parse_completion_request({"prompt": "p",
                                           "response_format": {"type": "json_object"}})
    assert '"json_object"' in completion.common.sampling.grammar


def test_completion_prompts() -> None:
    assert parse_completion_request({"prompt": "abc"}).prompt == "abc"
    assert parse_completion_request({"prompt": ["abc"]}).prompt == "abc"
    assert parse_completion_request({"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert parse_completion_request({"prompt": [[1, 2]]}).prompt == [1, 2]


@pytest.mark.parametrize(
    "prompt", [None, "", [], ["a", "b"], [1, "a"], [-1], 5, {"text": "x"}, [True]]
)
def test_bad_completion_prompts(prompt) -> None:
    bad("prompt", {"prompt": prompt}, parse_completion_request)


def test_completion_rejects_suffix_best_of() -> None:
    bad("suffix", {"prompt": "a", "suffix": "z"}, parse_completion_request)
    bad("best_of", {"prompt": "a", "best_of": 3}, parse_completion_request)
    bad("logprobs", {"prompt": "a", "logprobs": 6}, parse_completion_request)
    bad("max_tokens", {"prompt": "a", "max_tokens": 0}, parse_completion_request)


def test_logprobs_ride_on_the_sampling() -> None:
    chat = parse_chat_request({"messages": USER, "logprobs": True, "top_logprobs": 20})
    assert chat.common.sampling.logprobs == 20 and chat.common.sampling.prompt_logprobs is None
    assert parse_chat_request({"messages": USER}).common.sampling.logprobs is None
    echo = parse_completion_request({"prompt": "a", "echo": True, "logprobs": 1,
                                     "max_tokens": 0})
    assert echo.echo and echo.common.max_tokens == 0
    assert echo.common.sampling.logprobs == echo.common.sampling.prompt_logprobs == 1
    plain = parse_completion_request({"prompt": "a", "logprobs": 0})
    assert not plain.echo and plain.common.sampling.prompt_logprobs is None



@pytest.mark.parametrize(("param", "body"), [
    ("messages[0].role", {"messages": [{"role": {}, "content": "a"}]}),
    ("messages[0].role", {"messages": [{"role": [1], "content": "a"}]}),
    ("messages[0].tool_call_id", {"messages": [{"role": "tool", "content": "42"}]}),
    ("messages[0].tool_call_id", {"messages": [{"role": "tool", "content": "4",
                                                "tool_call_id": 7}]}),
    ("user", {"messages": USER, "user": {}}),
    ("seed", {"messages": USER, "seed": 10**30}),
    ("seed", {"messages": USER, "seed": -(2**70)}),
    ("top_k", {"messages": USER, "top_k": 10**30}),
    ("max_tokens", {"messages": USER, "max_tokens": 2**63}),
    ("temperature", {"messages": USER, "temperature": float("nan")}),
    ("min_p", {"messages": USER, "min_p": float("nan")}),
    ("chat_template_kwargs", {"messages": USER, "chat_template_kwargs": {"chat_template": "x"}}),
])  # fmt: skip
def test_hardening_refusals(param: str, body: dict) -> None:
    bad(param, body)


def test_int64_edges_and_missing_model_accepted() -> None:
    params = parse_chat_request({"messages": USER, "seed": 2**63 - 1, "top_k": 2**63 - 1})
    assert params.common.sampling.seed == 2**63 - 1
    assert parse_chat_request({"messages": USER, "seed": -(2**63)}).common.model is None
    tool = {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    assert parse_chat_request({"messages": [*USER, tool]}).messages[1]["tool_call_id"] == "call_1"


def test_speculative_extra_field_rides_on_the_sampling() -> None:
    assert parse_chat_request({"messages": USER}).common.sampling.speculative is None
    for method in ("ngram", "draft", "off"):
        body = {"messages": USER, "speculative": method}
        assert parse_chat_request(body).common.sampling.speculative == method
    completion = parse_completion_request({"prompt": "x", "speculative": "ngram"})
    assert completion.common.sampling.speculative == "ngram"
    bad("speculative", {"messages": USER, "speculative": "eagle"})
    bad("speculative", {"messages": USER, "speculative": 1})
