"""Forced tool calls on a real MLX model, through the three APIs' official SDKs.

The tiny checkpoint has random weights, so a tool call can only come from the
grammar: ``tool_choice`` "required" (chat), a named function (Responses) and
``any`` (Messages) each yield one call to an allowed tool whose arguments
validate against its schema, on a hybrid node and on a router + prefill +
decode cluster (where the decode node enforces the grammar it was handed),
the same call on both (greedy).
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from tests.integration.test_agent_apis_mlx import MODEL, hybrid, router  # noqa: F401

CITY = {"type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 12}}}  # fmt: skip
NOTHING = {"type": "object", "properties": {}, "additionalProperties": False}
SCHEMAS = {"get_weather": CITY, "get_time": NOTHING}
USER = [{"role": "user", "content": "Weather in Paris?"}]
pytestmark = pytest.mark.timeout(1200)


def chat_call(url: str) -> tuple[str, dict]:
    tools = [{"type": "function", "function": {"name": n, "parameters": s}}
             for n, s in SCHEMAS.items()]  # fmt: skip
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120) as c:
        reply = c.chat.completions.create(model=MODEL, messages=USER, tools=tools,
                                          tool_choice="required", max_tokens=60)  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0].function
    return call.name, json.loads(call.arguments)


def responses_call(url: str) -> tuple[str, dict]:
    tools = [{"type": "function", "name": n, "parameters": s} for n, s in SCHEMAS.items()]
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120) as c:
        response = c.responses.create(model=MODEL, input=USER, tools=tools, max_output_tokens=60,
                                      tool_choice={"type": "function", "name": "get_weather"})
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather"
    return call.name, json.loads(call.arguments)


def messages_call(url: str) -> tuple[str, dict]:
    tools = [{"name": n, "input_schema": s} for n, s in SCHEMAS.items()]
    with anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120) as c:
        message = c.messages.create(model=MODEL, messages=USER, tools=tools, max_tokens=60,
                                    tool_choice={"type": "any"})  # fmt: skip
    assert message.stop_reason == "tool_use", message
    (block,) = [b for b in message.content if b.type == "tool_use"]
    return block.name, block.input


@pytest.mark.parametrize("call", [chat_call, responses_call, messages_call])
def test_a_forced_call_on_hybrid_and_cluster(hybrid, router, call) -> None:  # noqa: F811
    on_hybrid = call(hybrid)
    name, arguments = on_hybrid
    jsonschema.validate(arguments, SCHEMAS[name])
    assert call(router) == on_hybrid
