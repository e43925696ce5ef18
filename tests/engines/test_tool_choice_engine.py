"""Forced tool choice on the MLX engine (tiny model, random weights): whatever it samples, the
grammar makes it exactly one call to an allowed tool, with arguments under that tool's schema.
"""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import numpy as np
import pytest
from tokenizers import Tokenizer

from engines.mlx_engine import MlxEngine
from mlxcel_plugin.engine_api import FINISH_STOP, EngineConfig, GenerationRequest, SamplingParams
from mlxcel_plugin.text.stream_filter import TOOL_CLOSE, TOOL_OPEN
from mlxcel_plugin.text.tool_calls import parse_tool_call
from mlxcel_plugin.text.tool_parsers import OURS_PARSER
from mlxcel_plugin.tool_choice import tool_call_grammar
from tests.engines import support

EOS = 2  # SmolLM2's <|im_end|>, the tiny checkpoint's eos
CITY = {"type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 12}}}  # fmt: skip
NOTHING = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": NOTHING}}]
SCHEMAS = {"get_weather": CITY, "get_time": NOTHING}
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=5)


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    eng = MlxEngine.from_path(str(tiny_model_path), EngineConfig(chunk_size_tokens=8))
    eng.start()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_path / "tokenizer.json"))


def request(rid: str, names: tuple[str, ...], params: SamplingParams,
            prompt_seed: int) -> GenerationRequest:  # fmt: skip
    rng = np.random.default_rng(prompt_seed)
    prompt = tuple(int(t) for t in rng.integers(3, 49152, 17))
    grammar = tool_call_grammar(names, TOOLS, OURS_PARSER)
    return GenerationRequest(rid, prompt, 80, dataclasses.replace(params, grammar=grammar),
                             stop_token_ids=(EOS,))


@pytest.mark.parametrize("names", [("get_weather", "get_time"), ("get_time",), ("get_weather",)])
@pytest.mark.parametrize("params", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_the_output_is_one_allowed_call(engine, tokenizer, names, params) -> None:
    for prompt_seed in (0, 1):
        events = support.generate(engine, request("forced", names, params, prompt_seed))
        assert events.last.finish_reason == FINISH_STOP
        text = tokenizer.decode([t for t in events.tokens if t != EOS])
        assert text.startswith(TOOL_OPEN) and text.endswith(TOOL_CLOSE), text
        call = parse_tool_call(text.removeprefix(TOOL_OPEN).removesuffix(TOOL_CLOSE).strip(), 0)
        assert call is not None and call.name in names, text
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_prefill_then_decode_continues_the_same_forced_call(engine) -> None:
    names = ("get_weather", "get_time")
    hybrid = support.generate(engine, request("one", names, SEEDED, 0)).tokens
    assert support.split(engine, request("two", names, SEEDED, 0)) == hybrid
