"""Tool calls: mlx-lm's parser for the families it covers (from the chat template), ours
elsewhere; tool-result turns on templates with and without tool support."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel_plugin.engine_api import FINISH_STOP, TokenEvent
from mlxcel_plugin.text import CompletionPipeline, StreamFilter, TextTokenizer
from mlxcel_plugin.text.chat_turns import TemplateSupport, template_messages
from mlxcel_plugin.text.pipeline import FINISH_TOOL_CALLS
from mlxcel_plugin.text.tool_parsers import OURS

REPO = Path(__file__).resolve().parents[3]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
# Templates carrying each family's markup, the way mlx-lm recognises them.
LOOP = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
TEMPLATES = {
    "qwen3_coder": "{# tools #}<tool_call>\n<function=...>" + LOOP,
    "json_tools": "{% for t in tools %}{{ t | tojson }}{% endfor %}"
                  "{# <tool_call> tool_call.name #}" + LOOP,
    "glm47": "{# tools <arg_key> #}" + LOOP,
    "mistral": "{# tools [TOOL_CALLS] #}" + LOOP,
    "pythonic": "{# tools <|tool_call_start|> #}" + LOOP,
}
OUTPUTS = {
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "</function>\n</tool_call>",
    "json_tools": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                  "</tool_call>",
    "glm47": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
             "</tool_call>",
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "pythonic": '<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>',
}


def tokenizer_with_template(root: Path, source: Path, template: str) -> TextTokenizer:
    root.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "special_tokens_map.json", "config.json"):
        shutil.copy(source / name, root / name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return TextTokenizer.from_dir(root)


def parsed(tokenizer: TextTokenizer, text: str, tools=None) -> tuple[list, str, str]:
    """(calls as (name, arguments), content, finish) of ``text`` as generated output."""
    pipeline = CompletionPipeline(tokenizer, max_tokens=200, parse_tools=True, tools=tools,
                                  stream_filter=StreamFilter(tokenizer.filter_markers))
    ids = tokenizer.encode(text, add_special_tokens=False)
    content, calls = "", []
    for i, token in enumerate(ids):
        delta = pipeline.feed(TokenEvent("r", i, token, FINISH_STOP if i == len(ids) - 1
                                         else None))
        content += delta.content
        calls += [(c.name, json.loads(c.arguments)) for c in delta.tool_calls]
    return calls, content, pipeline.finish_reason


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_mlx_lm_parses_the_families_it_covers(family: str, tmp_path, tokenizer_dir) -> None:
    tokenizer = tokenizer_with_template(tmp_path / family, Path(tokenizer_dir), TEMPLATES[family])
    assert tokenizer.tool_parser.name == family
    calls, content, finish = parsed(tokenizer, OUTPUTS[family])
    assert calls == [("get_weather", {"city": "Paris"})]
    assert content.strip() == "" and finish == FINISH_TOOL_CALLS


def test_the_tokenizer_config_may_name_the_parser(tmp_path, tokenizer_dir) -> None:
    root = tmp_path / "named"
    tokenizer_with_template(root, Path(tokenizer_dir), LOOP)
    config = json.loads((root / "tokenizer_config.json").read_text())
    (root / "tokenizer_config.json").write_text(json.dumps({**config,
                                                            "tool_parser_type": "glm47"}))
    assert TextTokenizer.from_dir(root).tool_parser.name == "glm47"


def test_a_template_mlx_lm_does_not_know_gets_ours(text_tokenizer: TextTokenizer) -> None:
    assert text_tokenizer.tool_parser.name == OURS  # the embedded SmolLM2 template
    calls, content, finish = parsed(text_tokenizer, "Sure. " + OUTPUTS["json_tools"])
    assert calls == [("get_weather", {"city": "Paris"})] and content == "Sure. "
    assert finish == FINISH_TOOL_CALLS


def test_unparseable_markup_stays_text(tmp_path, tokenizer_dir) -> None:
    tokenizer = tokenizer_with_template(tmp_path / "q", Path(tokenizer_dir),
                                        TEMPLATES["qwen3_coder"])
    calls, content, finish = parsed(tokenizer, "<tool_call>no function here</tool_call>")
    assert calls == [] and content == "no function here" and finish == FINISH_STOP


def test_the_tool_result_turn_renders_on_the_embedded_template(text_tokenizer, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="mlxcel_plugin.text.tokenizer"):
        first = text_tokenizer.render_chat(CALL_TURNS, tools=[WEATHER])
        text_tokenizer.render_chat(CALL_TURNS, tools=[WEATHER])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in first
    assert "<|im_start|>tool\nsunny<|im_end|>" in first
    ignored = [r for r in caplog.records if "ignores 'tools'" in r.getMessage()]
    assert len(ignored) <= 1  # once per tokenizer (an earlier test may have used it already)


def test_the_ignored_tools_warning_comes_once(tmp_path, tokenizer_dir, caplog) -> None:
    tokenizer = tokenizer_with_template(tmp_path / "plain", Path(tokenizer_dir), LOOP)
    with caplog.at_level(logging.WARNING, logger="mlxcel_plugin.text.tokenizer"):
        for _ in range(3):
            tokenizer.render_chat(CALL_TURNS[:1], tools=[WEATHER])
        tokenizer.render_chat(CALL_TURNS[:1])
    assert sum("ignores 'tools'" in r.getMessage() for r in caplog.records) == 1


def test_a_template_that_renders_tool_calls_gets_them_as_sent(tmp_path, tokenizer_dir) -> None:
    template = ("{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}[{{ c.function.name }}]{% endfor %}\n"
                "{% endfor %}{# tools #}")
    tokenizer = tokenizer_with_template(tmp_path / "calls", Path(tokenizer_dir), template)
    text = tokenizer.render_chat(CALL_TURNS, tools=[WEATHER])
    assert "assistant:[get_weather]" in text and "tool:sunny" in text


def test_template_messages_touch_only_what_the_template_lacks() -> None:
    both = TemplateSupport(tools=True, tool_calls=True)
    kept = template_messages(CALL_TURNS, both)
    assert kept[1]["content"] == "" and kept[1]["tool_calls"] == CALL_TURNS[1]["tool_calls"]
    assert kept[0] is CALL_TURNS[0] and CALL_TURNS[1]["content"] is None  # input untouched
    folded = template_messages(CALL_TURNS, TemplateSupport(tools=False, tool_calls=False))
    assert "tool_calls" not in folded[1] and folded[1]["content"].startswith("<tool_call>")
    assert TemplateSupport.of("{{ tools }} {{ m.tool_calls }}") == both


def test_loading_mlx_lm_parsers_imports_no_mlx() -> None:
    code = ("import sys\n"
            "from mlxcel_plugin.text.tool_parsers import _mlx_lm_inference, _mlx_lm_parser\n"
            "assert _mlx_lm_parser('glm47') and _mlx_lm_parser('laguna') and _mlx_lm_inference()\n"
            "loaded = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')]\n"
            "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_the_requests_tools_type_the_arguments(tmp_path, tokenizer_dir) -> None:
    tokenizer = tokenizer_with_template(tmp_path / "typed", Path(tokenizer_dir),
                                        TEMPLATES["qwen3_coder"])
    forecast = {"type": "function", "function": {"name": "forecast", "parameters": {
        "type": "object", "properties": {"days": {"type": "integer"}}}}}
    text = "<tool_call>\n<function=forecast>\n<parameter=days>\n3\n</parameter>\n</function>\n" \
           "</tool_call>"
    assert parsed(tokenizer, text)[0] == [("forecast", {"days": "3"})]
    assert parsed(tokenizer, text, [forecast])[0] == [("forecast", {"days": 3})]


def test_mlx_lm_model_type_defaults_pick_the_parser(tmp_path, tokenizer_dir) -> None:
    root = tmp_path / "muse"
    tokenizer_with_template(root, Path(tokenizer_dir), LOOP)
    (root / "config.json").write_text(json.dumps({"model_type": "muse_spark"}))
    assert TextTokenizer.from_dir(root).tool_parser.name == "muse_spark"
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))  # no defaults
    assert TextTokenizer.from_dir(root).tool_parser.name == OURS
