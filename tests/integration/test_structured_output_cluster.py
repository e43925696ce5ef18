"""Structured output through a real router + prefill + decode, and a hybrid node (tiny MLX model).

The prefill node samples the first token under the grammar, the decode node
replays it into its own matcher and goes on: every answer parses and validates
against its schema, and the cluster's bodies are the hybrid node's, byte for
byte (greedy and seeded, streamed or not).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import pytest

from tests.engines.test_grammar import SCHEMAS
from tests.integration.test_logprobs_cluster import concatenated, hybrid_then_cluster
from tests.integration.test_router_cluster import MODEL, normalize

pytestmark = pytest.mark.timeout(900)
ASK = [{"role": "user", "content": "Describe a fox as JSON."}]
NAMES = ("required_fields", "bounded_array", "nested", "array_of_objects", "enum_and_bool")


def json_schema(name: str) -> dict:
    return {"type": "json_schema",
            "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


CASES = [
    *(("/v1/chat/completions", {"messages": ASK, "max_tokens": 80,
                                "response_format": json_schema(name)}) for name in NAMES),
    ("/v1/chat/completions", {"messages": ASK, "max_tokens": 80, "stream": True,
                              "temperature": 0.9, "seed": 7,
                              "response_format": json_schema("array_of_objects")}),
    ("/v1/completions", {"prompt": "A fox:", "max_tokens": 80, "temperature": 1.0, "seed": 3,
                         "response_format": json_schema("required_fields")}),
    ("/v1/chat/completions", {"messages": ASK, "max_tokens": 3,
                              "response_format": json_schema("nested")}),
]


def answer(body: str) -> tuple[str, str]:
    """(text, finish_reason) of a chat or completions body, streamed or not."""
    if body.startswith("data: "):
        joined = json.loads(concatenated(body))
        return joined["text"], joined["finish"][-1]
    choice = json.loads(body)["choices"][0]
    return choice.get("text", (choice.get("message") or {}).get("content")), choice[
        "finish_reason"]


def bodies(url: str) -> list[str]:
    with httpx.Client(timeout=300) as http:
        out = []
        for path, body in CASES:
            r = http.post(f"{url}{path}", json={"model": MODEL, **body})
            assert r.status_code == 200, r.text
            out.append(normalize(r.text))
        return out


def test_cluster_output_validates_and_matches_hybrid(tiny_model_path: Path, tmp_path) -> None:
    expected, routed = hybrid_then_cluster(tmp_path, str(tiny_model_path), "mlx", bodies)
    for (_, case), want, got in zip(CASES, expected, routed, strict=True):
        assert got == want, case
        text, finish = answer(got)
        if case["max_tokens"] == 3:  # cut short: OpenAI's "length", the JSON left unfinished
            assert finish == "length"
            with pytest.raises(json.JSONDecodeError):
                json.loads(text)
            continue
        assert finish == "stop", (case, text)
        schema = case["response_format"]["json_schema"]["schema"]
        jsonschema.validate(json.loads(text), schema)
