"""response_format → grammar spec, and the spec's way through frames and the handoff header."""

from __future__ import annotations

import json

import pytest

from mlxcel_plugin.engine_api import GenerationRequest, SamplingParams
from mlxcel_plugin.errors import InvalidRequestError
from mlxcel_plugin.kv_serde import HandoffHeader, SerializableSamplingState
from mlxcel_plugin.kv_serde.errors import MalformedHandoff
from mlxcel_plugin.link.protocol.frames import MalformedFrame, Request
from mlxcel_plugin.nodes.requests import sampling_params
from mlxcel_plugin.structured_output import (
    MAX_GRAMMAR_CHARS,
    GrammarSpec,
    parse_response_format,
)
from mlxcel_plugin.testing.caches import make_fingerprint

PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def json_schema(schema, strict=None, name="person") -> dict:
    inner = {"name": name, "schema": schema}
    if strict is not None:
        inner["strict"] = strict
    return {"type": "json_schema", "json_schema": inner}


def test_text_and_absent_mean_unconstrained() -> None:
    assert parse_response_format(None) is None
    assert parse_response_format({"type": "text"}) is None


def test_json_object_and_json_schema_become_canonical_specs() -> None:
    assert GrammarSpec.from_text(parse_response_format({"type": "json_object"})) == GrammarSpec(
        "json_object")
    text = parse_response_format(json_schema(PERSON, strict=True))
    assert GrammarSpec.from_text(text) == GrammarSpec("json_schema", PERSON, True, "person")
    assert text == parse_response_format(json_schema(dict(reversed(PERSON.items())), True))


def test_a_schema_may_be_left_out() -> None:
    spec = GrammarSpec.from_text(parse_response_format(json_schema(None)))
    assert spec.schema is None and spec.kind == "json_schema"


@pytest.mark.parametrize("value", [
    "json", {"kind": "json_object"}, {"type": "yaml"}, {"type": "json_schema"},
    json_schema(PERSON, name=""), json_schema(PERSON, name="has space"),
    json_schema(PERSON, name="x" * 65), json_schema(PERSON, strict="yes"),
    json_schema([1, 2]), json_schema({"type": "strin"}), json_schema({"$ref": "#/nowhere"}),
])  # fmt: skip
def test_bad_response_formats_are_400s_naming_the_field(value) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_response_format(value)
    assert caught.value.param == "response_format"


def test_strict_refuses_keywords_the_grammar_cannot_enforce() -> None:
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(InvalidRequestError, match="uniqueItems"):
        parse_response_format(json_schema(unique, strict=True))
    assert parse_response_format(json_schema(unique, strict=False)) is not None
    assert GrammarSpec.from_text(parse_response_format(json_schema(unique))).strict is False


def test_an_oversized_schema_is_refused() -> None:
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                            for i in range(MAX_GRAMMAR_CHARS // 20)}}
    with pytest.raises(InvalidRequestError, match="characters"):
        parse_response_format(json_schema(big))


@pytest.mark.parametrize("text", ["not json", "[1]", '{"type": "regex"}',
                                  '{"type": "json_schema", "schema": 3}'])
def test_a_peers_spec_is_checked_too(text: str) -> None:
    with pytest.raises(InvalidRequestError):
        GrammarSpec.from_text(text)


def test_sampling_params_keep_their_bytes_without_a_grammar() -> None:
    data = SamplingParams().to_dict()
    assert "grammar" not in data and "grammar_replay_tokens" not in data
    constrained = SamplingParams(grammar='{"type":"json_object"}', grammar_replay_tokens=3)
    assert SamplingParams.from_dict(constrained.to_dict()) == constrained


def test_the_spec_rides_the_request_frame_to_the_engine_request() -> None:
    spec = parse_response_format(json_schema(PERSON))
    params = SamplingParams(temperature=0.5, grammar=spec, grammar_replay_tokens=2)
    frame = Request("r", [1, 2, 3], params.to_dict(), 8, [2]).to_frame()
    parsed = Request.from_frame(frame)
    assert sampling_params(parsed.sampling) == params


@pytest.mark.parametrize("sampling", [{"grammar": 5}, {"grammar": "x" * (MAX_GRAMMAR_CHARS + 1)},
                                      {"grammar_replay_tokens": -1}])
def test_a_request_frame_bounds_the_spec(sampling) -> None:
    with pytest.raises(MalformedFrame):
        Request("r", [1, 2], sampling, 8, []).to_frame()


def test_a_node_refuses_a_spec_that_is_not_text() -> None:
    with pytest.raises(InvalidRequestError):
        sampling_params({"grammar": 3})


FP = make_fingerprint(num_layers=2, kv_heads=1, head_dim=4, dtype="float16")


def test_the_spec_rides_the_handoff_header() -> None:
    spec = parse_response_format({"type": "json_object"})
    request = GenerationRequest("r", (5, 6, 7), 9, SamplingParams(grammar=spec,
                                                                  grammar_replay_tokens=1))
    header = HandoffHeader("r", "h", 0, FP, 3, 8,
                           sampling=SerializableSamplingState.from_request(request))
    assert HandoffHeader.from_message(header.to_message()).to_request() == request


def test_a_handoff_header_checks_the_spec_field() -> None:
    header = HandoffHeader("r", "h", 0, FP, 3, 8)
    message = header.to_message()
    message.header["sampling"]["params"]["grammar"] = ["not", "text"]
    with pytest.raises(MalformedHandoff):
        HandoffHeader.from_message(message)
    assert json.loads(parse_response_format({"type": "json_object"}))["type"] == "json_object"
