"""The agent APIs end to end: a real hybrid node and a real router cluster on 127.0.0.1,
driven by the official ``openai`` (Responses) and ``anthropic`` (Messages) SDKs.

The nodes run engine ``agent-script`` (``agent_script_engine.py``): the fake
engine answering like a tool-using model, a pure function of the prompt, so a
prefill and a decode node agree. It arrives through a real ``mlxcel`` entry
point written into a temporary ``.dist-info`` on the nodes' ``PYTHONPATH``.
Each test runs against both servers; an agent loop (the model calls a tool,
the client runs it and sends the result, the model answers) runs with both
SDKs.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from mlxcel_plugin.local_cluster import LocalCluster, NodeProcess, start_node
from tests.integration.agent_script_engine import ANSWER, ENGINE, GREETING, TOOL_RESULT
from tests.integration.test_router_cluster import fake_model_dir

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 240
MODEL = "tiny"
ENTRY_POINTS = f"[mlxcel]\n{ENGINE} = tests.integration.agent_script_engine\n"
WEATHER_FN = {"type": "function", "name": "get_weather", "description": "Weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                             "required": ["city"]}}
WEATHER_TOOL = {"name": "get_weather", "description": "Weather of a city",
                "input_schema": WEATHER_FN["parameters"]}
pytestmark = pytest.mark.timeout(900)


def get_weather(city: str) -> str:
    """The tool the client runs (as an agent would)."""
    return TOOL_RESULT if city == "Paris" else "unknown"


def plugin_env(root: Path) -> dict[str, str]:
    """An installed-looking distribution whose entry point registers the engine."""
    info = root / "mlxcel_agent_script-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mlxcel-agent-script\n"
                                   "Version: 0.1\n")  # fmt: skip
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    path = os.pathsep.join(p for p in (str(root), str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path}
    if os.environ.get("MLXCEL_PLUGINS"):  # an allow-list in force must admit this plugin
        env["MLXCEL_PLUGINS"] = f"{os.environ['MLXCEL_PLUGINS']},{ENGINE}"
    return env


@pytest.fixture(scope="module")
def model_and_env(tiny_model_path, tmp_path_factory) -> tuple[str, dict[str, str]]:
    root = tmp_path_factory.mktemp("agent")
    return fake_model_dir(root / "model", tiny_model_path), plugin_env(root / "site")


NODE_ARGS = ["--engine", ENGINE, "--served-model-name", MODEL, "--no-warmup"]


@pytest.fixture(scope="module")
def hybrid(model_and_env, tmp_path_factory) -> Iterator[str]:
    model, env = model_and_env
    node: NodeProcess = start_node("hybrid", tmp_path_factory.mktemp("hybrid"),
                                   ["--model", model, *NODE_ARGS], env=env)  # fmt: skip
    try:
        node.wait_healthy(STARTUP_TIMEOUT_S)
        yield node.url
    finally:
        node.stop()


@pytest.fixture(scope="module")
def router(model_and_env, tmp_path_factory) -> Iterator[str]:
    model, env = model_and_env
    cluster = LocalCluster(workdir=tmp_path_factory.mktemp("cluster"), model=model,
                           common_args=NODE_ARGS, env=env)  # fmt: skip
    cluster.start(STARTUP_TIMEOUT_S)
    try:
        yield cluster.router.url
    finally:
        cluster.stop()


@pytest.fixture(params=["hybrid", "router"])
def server(request) -> str:
    return request.getfixturevalue(request.param)


@pytest.fixture
def oai(server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0,
                       timeout=60) as client:  # fmt: skip
        yield client


@pytest.fixture
def claude(server) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server, api_key="none", max_retries=0,
                             timeout=60) as client:  # fmt: skip
        yield client


# -- OpenAI Responses -------------------------------------------------------------------


def test_responses_create(oai) -> None:
    response = oai.responses.create(model=MODEL, input="Say hi", instructions="Be brief.")
    assert response.status == "completed" and response.output_text == GREETING
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0
    assert response.usage.input_tokens_details.cached_tokens >= 0


def test_responses_agent_loop_with_previous_response_id(oai) -> None:
    first = oai.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER_FN])
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather"
    result = get_weather(**json.loads(call.arguments))
    second = oai.responses.create(model=MODEL, previous_response_id=first.id,
                                  tools=[WEATHER_FN], input=[{
                                      "type": "function_call_output", "call_id": call.call_id,
                                      "output": result}])  # fmt: skip
    assert second.output_text == ANSWER
    assert oai.responses.retrieve(second.id).output_text == ANSWER
    oai.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(second.id)
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model=MODEL, previous_response_id=second.id, input="more")


def test_responses_stream(oai) -> None:
    with oai.responses.stream(model=MODEL, input="Say hi") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and final.output_text == GREETING


def test_responses_stream_of_a_tool_call(oai) -> None:
    events = list(oai.responses.create(model=MODEL, input="Weather in Paris?",
                                       tools=[WEATHER_FN], stream=True))  # fmt: skip
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done[0].arguments) == {"city": "Paris"}
    assert events[-1].type == "response.completed"


def test_responses_text_format_json_schema(oai) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    response = oai.responses.create(model=MODEL, input="Answer in JSON", text={"format": {
        "type": "json_schema", "name": "ok", "schema": schema, "strict": True}})
    assert json.loads(response.output_text) == {"ok": True}


# -- Anthropic Messages -------------------------------------------------------------------


def test_messages_create_and_count_tokens(claude) -> None:
    message = claude.messages.create(model=MODEL, max_tokens=64, system="Be brief.",
                                     messages=[{"role": "user", "content": "Say hi"}])
    assert message.content[0].text == GREETING and message.stop_reason == "end_turn"
    counted = claude.messages.count_tokens(model=MODEL, system="Be brief.",
                                           messages=[{"role": "user", "content": "Say hi"}])
    assert counted.input_tokens == (message.usage.input_tokens
                                    + message.usage.cache_read_input_tokens)  # fmt: skip


def test_messages_stream(claude) -> None:
    with claude.messages.stream(model=MODEL, max_tokens=64,
                                messages=[{"role": "user", "content": "Say hi"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == GREETING and final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 0


def test_messages_agent_loop(claude) -> None:
    history = [{"role": "user", "content": "Weather in Paris?"}]
    first = claude.messages.create(model=MODEL, max_tokens=32000, tools=[WEATHER_TOOL],
                                   messages=history)  # fmt: skip
    assert first.stop_reason == "tool_use"
    (use,) = [block for block in first.content if block.type == "tool_use"]
    history += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": get_weather(**use.input)}]}]
    with claude.messages.stream(model=MODEL, max_tokens=256, tools=[WEATHER_TOOL],
                                messages=history) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert final.content[0].text == ANSWER and final.stop_reason == "end_turn"


def test_messages_errors_are_the_sdks_typed_exceptions(claude) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=MODEL, max_tokens=16, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope",
                                          "content": "x"}]}])
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-elsewhere", max_tokens=16,
                               messages=[{"role": "user", "content": "hi"}])


# -- hostile input beside a running stream; hybrid and router agree -----------------------


def test_bad_input_is_4xx_and_other_streams_go_on(server, oai) -> None:
    bad = [("/v1/responses", {"input": [{"type": "mystery"}]}),
           ("/v1/responses", {"input": "x" * 2_000_000}),
           ("/v1/messages", {"max_tokens": "many", "messages": []}),
           ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": 5}]})]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(lambda: list(oai.responses.create(
            model=MODEL, input="Weather in Paris?", tools=[WEATHER_FN], stream=True)))
        statuses = [httpx.post(f"{server}{path}", json=body, timeout=60).status_code
                    for path, body in bad]
        events = streamed.result(timeout=120)
    assert all(400 <= status < 500 for status in statuses), statuses
    assert events[-1].type == "response.completed"


def _normalized(body: dict) -> dict:
    drop = {"id", "created_at"}
    output = [{k: v for k, v in item.items() if k != "id"} for item in body["output"]]
    return {**{k: v for k, v in body.items() if k not in drop}, "output": output}


def test_hybrid_and_router_answer_the_same(hybrid, router) -> None:
    request = {"model": MODEL, "input": "Weather in Paris?", "tools": [WEATHER_FN]}
    bodies = [httpx.post(f"{url}/v1/responses", json=request, timeout=60).json()
              for url in (hybrid, router)]
    assert _normalized(bodies[0]) == _normalized(bodies[1])
