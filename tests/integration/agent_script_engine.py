"""A test plugin: engine ``agent-script``, the fake engine replying like a tool-using model.

Loaded by real node processes through a real ``mlxcel`` entry point that
``tests/integration/test_agent_apis.py`` writes into a temporary
``.dist-info`` on ``PYTHONPATH``. Its reply is a pure function of the prompt
text, so a prefill node and a decode node agree on it (the cluster path):

* a prompt holding the tool's result ("sunny, 21 C") → an answer;
* a prompt asking for the weather → a ``<tool_call>`` to ``get_weather``;
* a prompt asking for JSON → ``{"ok":true}``;
* a prompt asking for the weather and the time (``BOTH``) → ``get_weather``,
  then with its result ``get_time``, then with both results an answer (a
  two-tool agent);
* anything else → "Hello there."
"""

from __future__ import annotations

from typing import Any

from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest
from mlxcel_plugin.hookspecs import hookimpl
from mlxcel_plugin.testing.fake_engine import FakeEngine, FakeEngineSettings
from mlxcel_plugin.text import TextTokenizer

ENGINE = "agent-script"
TOOL_RESULT = "sunny, 21 C"
ANSWER = "It is sunny in Paris."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
GREETING = "Hello there."
JSON_ANSWER = '{"ok":true}'
BOTH = "Weather and time in Paris?"
TIME_RESULT = "14:05 CET"
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>'
BOTH_ANSWER = "It is sunny in Paris, and 14:05."


def answer_both(prompt: str) -> str:
    asked = prompt.rfind(BOTH)
    if prompt.rfind(TIME_RESULT) > asked:
        return BOTH_ANSWER
    return TIME_CALL if prompt.rfind(TOOL_RESULT) > asked else CALL


def answer(prompt: str) -> str:
    if BOTH in prompt:
        return answer_both(prompt)
    asked, answered = prompt.rfind("Weather"), prompt.rfind(TOOL_RESULT)
    if answered > asked:  # the tool's result came after the question: answer it
        return ANSWER
    if asked >= 0:
        return CALL
    if "JSON" in prompt:
        return JSON_ANSWER
    return GREETING


def make_agent_engine(model_path: str | None, config: EngineConfig) -> FakeEngine:
    tokenizer = TextTokenizer.from_dir(model_path)
    eos = tokenizer.eos_token_ids

    def script(request: GenerationRequest) -> list[int]:
        text = answer(tokenizer.decode(list(request.prompt_tokens)))
        return tokenizer.encode(text, add_special_tokens=False) + [eos[0]]

    settings = FakeEngineSettings.from_dir(model_path)
    return FakeEngine(settings, config, script=script, eos_token_ids=eos)


@hookimpl
def mlxcel_register_engines(register: Any) -> None:
    register(ENGINE, make_agent_engine)
