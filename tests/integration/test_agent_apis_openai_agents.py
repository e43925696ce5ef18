"""The ``openai-agents`` SDK runs a two-tool agent against a real router cluster (127.0.0.1).

The SDK drives ``/v1/responses`` itself: it sends the tools, reads the model's
``function_call`` items, runs the Python tools, sends their results back as
``function_call_output`` items with the whole history, and stops at the
answer. The nodes run the ``agent-script`` engine (``agent_script_engine.py``),
which for ``BOTH`` calls ``get_weather``, then ``get_time``, then answers.
Tracing is off (no network): ``set_tracing_disabled`` and
``OPENAI_AGENTS_DISABLE_TRACING``.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.integration.agent_script_engine import BOTH, BOTH_ANSWER, TIME_RESULT, TOOL_RESULT
from tests.integration.test_agent_apis import MODEL, model_and_env, router  # noqa: F401

agents = pytest.importorskip("agents")
pytestmark = pytest.mark.timeout(900)


def make_agent(calls: list[tuple[str, str]], model: object) -> object:
    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        calls.append(("get_weather", city))
        return TOOL_RESULT

    @agents.function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        calls.append(("get_time", city))
        return TIME_RESULT

    return agents.Agent(name="assistant", instructions="Use the tools, then answer briefly.",
                        tools=[get_weather, get_time], model=model)  # fmt: skip


async def run_agent(url: str) -> tuple[object, list[tuple[str, str]]]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                timeout=60)  # fmt: skip
    calls: list[tuple[str, str]] = []
    try:
        model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
        result = await agents.Runner.run(make_agent(calls, model), BOTH, max_turns=6)
    finally:
        await client.close()
    return result, calls


def test_a_two_tool_agent_runs_against_the_router(router, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    agents.set_tracing_disabled(True)
    result, calls = asyncio.run(run_agent(router))
    assert calls == [("get_weather", "Paris"), ("get_time", "Paris")]
    assert result.final_output == BOTH_ANSWER
    responses = result.raw_responses
    assert len(responses) == 3  # call, call, answer: one /v1/responses request per turn
    # Each turn resends the growing history (the fake engine keeps no prefix cache).
    inputs = [r.usage.input_tokens for r in responses]
    assert inputs == sorted(inputs) and inputs[0] > 0, inputs
