"""One conversation through chat completions, Responses and Messages on a real MLX model.

The tiny checkpoint (greedy) on a hybrid node and on a router + prefill +
decode cluster (prefix-aware balancers): each API's reply to the same two-turn
conversation (a long system prompt, then questions) is the chat reply, byte
for byte, on both servers; the second turn is served partly from the prefix
cache and each API reports it (``cached_tokens``, ``cache_read_input_tokens``).
The Responses turn 2 continues by ``previous_response_id`` alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from mlxcel_plugin.local_cluster import LocalCluster, start_node

STARTUP_TIMEOUT_S = 300
MODEL = "tiny"
MAX_TOKENS = 12
SYSTEM = " ".join(f"Rule {i}: answer with care about topic {i * 7 % 31}." for i in range(60))
QUESTIONS = ("Question 0: what about item 0?", "Question 1: what about item 1?")
ARGS = ["--served-model-name", MODEL, "--no-warmup"]
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def hybrid(tiny_model_path: Path, tmp_path_factory) -> Iterator[str]:
    node = start_node("hybrid", tmp_path_factory.mktemp("hybrid"),
                      ["--model", str(tiny_model_path), *ARGS])  # fmt: skip
    try:
        node.wait_healthy(STARTUP_TIMEOUT_S)
        yield node.url
    finally:
        node.stop()


@pytest.fixture(scope="module")
def router(tiny_model_path: Path, tmp_path_factory) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("cluster")
    toml = workdir / "cluster.toml"
    toml.write_text('[server]\nprefill_balancer = "prefix-aware"\n'
                    'decode_balancer = "prefix-aware"\n')  # fmt: skip
    cluster = LocalCluster(workdir=workdir, model=str(tiny_model_path),
                           common_args=[*ARGS, "--distributed-config", str(toml)])  # fmt: skip
    cluster.start(STARTUP_TIMEOUT_S)
    try:
        yield cluster.router.url
    finally:
        cluster.stop()


def chat_turns(client: openai.OpenAI) -> list[str]:
    messages, replies = [{"role": "system", "content": SYSTEM}], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        response = client.chat.completions.create(model=MODEL, messages=messages,
                                                  max_tokens=MAX_TOKENS)  # fmt: skip
        replies.append(response.choices[0].message.content or "")
        messages.append({"role": "assistant", "content": replies[-1]})
    return replies


def responses_turns(client: openai.OpenAI) -> tuple[list[str], int]:
    first = client.responses.create(model=MODEL, instructions=SYSTEM, input=QUESTIONS[0],
                                    max_output_tokens=MAX_TOKENS)  # fmt: skip
    second = client.responses.create(model=MODEL, instructions=SYSTEM, input=QUESTIONS[1],
                                     previous_response_id=first.id,
                                     max_output_tokens=MAX_TOKENS)  # fmt: skip
    cached = second.usage.input_tokens_details.cached_tokens
    return [first.output_text, second.output_text], cached


def messages_turns(client: anthropic.Anthropic) -> tuple[list[str], int]:
    history: list[dict] = []
    replies, cached = [], 0
    for question in QUESTIONS:
        history.append({"role": "user", "content": question})
        message = client.messages.create(model=MODEL, system=SYSTEM, messages=history,
                                         max_tokens=MAX_TOKENS)  # fmt: skip
        replies.append("".join(b.text for b in message.content if b.type == "text"))
        cached = message.usage.cache_read_input_tokens
        history.append({"role": "assistant", "content": replies[-1]})
    return replies, cached


def all_apis(url: str) -> dict[str, object]:
    with (openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                        timeout=300) as oai,
          anthropic.Anthropic(base_url=url, api_key="none", max_retries=0,
                              timeout=300) as claude):  # fmt: skip
        return {"chat": chat_turns(oai), "responses": responses_turns(oai),
                "messages": messages_turns(claude)}  # fmt: skip


def test_three_apis_one_conversation_same_tokens_hybrid_and_cluster(hybrid, router) -> None:
    results = {name: all_apis(url) for name, url in (("hybrid", hybrid), ("router", router))}
    for name, result in results.items():
        chat = result["chat"]
        (responses, responses_cached), (messages, messages_cached) = (result["responses"],
                                                                      result["messages"])
        assert responses == chat, name
        assert messages == chat, name
        assert responses_cached > 0 and messages_cached > 0, (name, result)
    assert results["hybrid"]["chat"] == results["router"]["chat"]
