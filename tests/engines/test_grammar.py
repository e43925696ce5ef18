"""Constrained decoding on the MLX engine (tiny model): the output is what the schema allows.

The tiny model's weights are random, so whatever it produces comes from the
grammar alone: schemas here bound their strings, numbers and arrays so a
decode ends well within ``max_tokens``.
"""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import numpy as np
import pytest
from tokenizers import Tokenizer

from engines.grammar import GrammarConstraint, grammar_tokenizer, request_constraint
from engines.mlx_engine import MlxEngine
from mlxcel_plugin.engine_api import (
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
)
from mlxcel_plugin.structured_output import parse_response_format
from tests.engines import support

EOS = 2  # SmolLM2's <|im_end|>, the tiny checkpoint's eos
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=5)
GREEDY = SamplingParams()
STRICT = {"additionalProperties": False}


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, **STRICT}


SCHEMAS = {
    "required_fields": obj({"name": {"type": "string", "maxLength": 10},
                            "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "enum_and_bool": obj({"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}}),
    "bounded_array": obj({"xs": {"type": "array", "minItems": 1, "maxItems": 4,
                                 "items": {"type": "integer", "minimum": -5, "maximum": 5}}}),
    "nested": obj({"point": obj({"x": {"type": "number", "minimum": 0, "maximum": 1},
                                 "y": {"type": "integer", "exclusiveMinimum": 10,
                                       "maximum": 20}}),
                   "tag": {"const": "v1"}}),
    "optional_fields": obj({"a": {"type": "boolean"}, "b": {"type": "null"}}, required=["a"]),
    "array_of_objects": obj({"items": {"type": "array", "maxItems": 3,
                                       "items": obj({"id": {"type": "integer", "minimum": 1,
                                                            "maximum": 9}})}}),
    "any_of": obj({"v": {"anyOf": [{"type": "boolean"}, {"enum": [1, 2, 3]}]}}),
    "string_enum_top_level": {"enum": ["yes", "no", "maybe"]},
}


def grammar(schema: dict | None, strict: bool = True) -> str:
    if schema is None:
        return parse_response_format({"type": "json_object"})
    return parse_response_format({"type": "json_schema", "json_schema": {
        "name": "out", "schema": schema, "strict": strict}})


def request(name: str, spec: str, params: SamplingParams = GREEDY,
            max_tokens: int = 80, prompt_seed: int = 0) -> GenerationRequest:
    rng = np.random.default_rng(prompt_seed)
    prompt = tuple(int(t) for t in rng.integers(3, 49152, 17))
    return GenerationRequest(name, prompt, max_tokens, dataclasses.replace(params, grammar=spec),
                             stop_token_ids=(EOS,))


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    eng = MlxEngine.from_path(str(tiny_model_path), EngineConfig(chunk_size_tokens=8))
    eng.start()
    yield eng
    eng.close()


def test_a_warmed_up_engine_builds_the_grammar_tokenizer_before_any_request(tiny_model_path):
    grammar_tokenizer.cache_clear()
    cold = MlxEngine.from_path(str(tiny_model_path), EngineConfig(chunk_size_tokens=8,
                                                                  warmup=False))
    cold.start()
    cold.close()
    assert grammar_tokenizer.cache_info().currsize == 0  # --no-warmup: built on first use
    warm = MlxEngine.from_path(str(tiny_model_path), EngineConfig(chunk_size_tokens=8))
    warm.start()
    warm.close()
    assert grammar_tokenizer.cache_info().currsize == 1


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_path / "tokenizer.json"))


def text_of(tokenizer: Tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode([t for t in tokens if t != EOS])


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("params", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_output_parses_and_validates(engine, tokenizer, name: str, params) -> None:
    for prompt_seed in (0, 1):
        events = support.generate(engine, request(name, grammar(SCHEMAS[name]), params,
                                                  prompt_seed=prompt_seed))
        assert events.last.finish_reason == FINISH_STOP
        jsonschema.validate(json.loads(text_of(tokenizer, events.tokens)), SCHEMAS[name])


def test_json_object_is_an_object(engine, tokenizer) -> None:
    # A random model nests freely: the bound is max_tokens, and a stop means a whole object.
    for seed in range(4):
        params = dataclasses.replace(SEEDED, seed=seed)
        events = support.generate(engine, request("obj", grammar(None), params, max_tokens=60))
        text = text_of(tokenizer, events.tokens)
        if events.last.finish_reason == FINISH_STOP:
            assert isinstance(json.loads(text), dict)
        else:
            assert events.last.finish_reason == FINISH_LENGTH and text.startswith("{")


def test_max_tokens_cuts_the_json_with_length(engine, tokenizer) -> None:
    events = support.generate(engine, request("cut", grammar(SCHEMAS["nested"]), max_tokens=4))
    assert events.last.finish_reason == FINISH_LENGTH and len(events.tokens) == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(text_of(tokenizer, events.tokens))


@pytest.mark.parametrize("params", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_prefill_then_decode_continues_the_same_constrained_decode(engine, params) -> None:
    spec = grammar(SCHEMAS["array_of_objects"])
    hybrid = support.generate(engine, request("one", spec, params)).tokens
    assert support.split(engine, request("two", spec, params)) == hybrid


def test_a_migrated_request_replays_the_streamed_tokens(engine) -> None:
    whole = request("whole", grammar(SCHEMAS["required_fields"]), SEEDED)
    tokens = support.generate(engine, whole).tokens
    streamed = 5
    moved = dataclasses.replace(
        whole, request_id="moved", prompt_tokens=whole.prompt_tokens + tuple(tokens[:streamed]),
        max_tokens=whole.max_tokens - streamed,
        sampling=dataclasses.replace(whole.sampling, grammar_replay_tokens=streamed))
    assert support.generate(engine, moved).tokens == tokens[streamed:]


def test_a_grammar_that_does_not_fit_the_replayed_tokens_fails_the_request(engine) -> None:
    bad = dataclasses.replace(request("bad", grammar(SCHEMAS["enum_and_bool"])),
                              prompt_tokens=(5, 6, 7))
    bad = dataclasses.replace(bad, sampling=dataclasses.replace(bad.sampling,
                                                                grammar_replay_tokens=2))
    assert support.generate(engine, bad).last.finish_reason == FINISH_ERROR


def test_stop_tokens_are_allowed_once_the_grammar_accepts(engine, tokenizer) -> None:
    info = engine.info
    constraint = request_constraint(request("c", grammar(SCHEMAS["enum_and_bool"])), info)
    assert isinstance(constraint, GrammarConstraint)
    assert not constraint.allowed()[EOS]  # "{" must come first
    for token in tokenizer.encode('{"color":"red","ok":true}', add_special_tokens=False).ids:
        assert constraint.allowed()[token]
        constraint.advance(token)
    allowed = constraint.allowed()
    assert allowed[EOS] and allowed.sum() == 1


def test_masked_logits_keep_only_allowed_tokens(engine) -> None:
    constraint = request_constraint(request("m", grammar(SCHEMAS["enum_and_bool"])), engine.info)
    logits = np.zeros(engine.info.vocab_size, dtype=np.float32)
    masked = constraint.mask(logits)
    assert np.array_equal(np.isfinite(masked), constraint.allowed())
    assert np.all(logits == 0)  # the raw row (logprobs read it) is left alone


def test_no_grammar_no_constraint(engine) -> None:
    plain = GenerationRequest("p", (5, 6, 7), 4)
    assert request_constraint(plain, engine.info) is None


class OnlyToken:
    """A stand-in constraint: one token allowed; records what it was told."""

    def __init__(self, token: int):
        self.token, self.seen = token, []

    def mask(self, logits: np.ndarray) -> np.ndarray:
        out = np.full_like(logits, -np.inf)
        out[self.token] = logits[self.token]
        return out

    def advance(self, token: int) -> None:
        self.seen.append(token)


@pytest.mark.parametrize("params", [GREEDY, SEEDED,
                                    SamplingParams(repetition_penalty=1.3, top_k=5)])
def test_the_sampler_samples_only_what_its_constraint_allows(params) -> None:
    from engines.sampling import TokenSampler

    constraint = OnlyToken(7)
    sampler = TokenSampler(dataclasses.replace(params, logprobs=2), [7, 7, 1], 50, constraint)
    row = np.random.default_rng(0).standard_normal(50).astype(np.float32)
    token = sampler.sample(row, 3)
    sampler.observe(token)
    assert token == 7 and constraint.seen == [7]
    assert sampler.logprobs(row, token).top_ids[0] == int(np.argmax(row))  # raw, not masked
