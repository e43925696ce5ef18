"""RESULT frames with logprobs: carried exactly; absent, the frame keeps its old bytes."""

from __future__ import annotations

import numpy as np
import pytest

from mlxcel_plugin.kv_serde.errors import MalformedHandoff
from mlxcel_plugin.kv_serde.header import SerializableSamplingState
from mlxcel_plugin.link.protocol.frames import (
    MalformedFrame,
    Request,
    Result,
    decode_frame,
    encode_frame,
)
from mlxcel_plugin.link.protocol.request_checks import FieldOutOfRange
from mlxcel_plugin.logprobs import TokenLogprobs, logprob_rows
from mlxcel_plugin.nodes.requests import sampling_params


def through_wire(result: Result) -> Result:
    return Result.from_frame(decode_frame(encode_frame(result.to_frame())))


def test_a_result_without_logprobs_has_no_new_fields() -> None:
    frame = Result("r", 1, [5], None, 2).to_frame()
    assert "logprobs" not in frame.header and "prompt_logprobs_top" not in frame.header
    assert bytes(frame.body) == b""


def test_token_and_prompt_logprobs_travel_exactly() -> None:
    prompt = logprob_rows(np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32),
                          [1, 2, 3, 4], 3)
    result = Result("r", 0, [7, 8], None, 2, cached_tokens=0,
                    logprobs=(TokenLogprobs(-0.25, (7,), (-0.25,)),
                              TokenLogprobs(-1.5, (3,), (-0.5,))),
                    prompt_logprobs=prompt)
    assert through_wire(result) == result


def test_logprobs_that_do_not_fit_the_tokens_are_malformed() -> None:
    frame = Result("r", 0, [7, 8], None, 2).to_frame()
    frame.header["logprobs"] = [[-1.0, [], []]]
    with pytest.raises(MalformedFrame):
        Result.from_frame(decode_frame(encode_frame(frame)))


def test_a_request_asks_logprobs_in_its_sampling_and_nodes_bound_them() -> None:
    asked = {"logprobs": 5, "prompt_logprobs": 1}
    assert sampling_params(asked).logprobs == 5
    assert sampling_params(asked).prompt_logprobs == 1
    with pytest.raises(FieldOutOfRange):
        Request("r", [1], {"logprobs": 21}).to_frame()


def test_the_handoff_header_carries_the_logprobs_wish() -> None:
    state = SerializableSamplingState(sampling_params({"logprobs": 2}), (1, 2), 1, (), 4)
    assert SerializableSamplingState.from_dict(state.to_dict(), (1, 2)) == state
    data = state.to_dict()
    data["params"]["logprobs"] = 99
    with pytest.raises(MalformedHandoff):
        SerializableSamplingState.from_dict(data, (1, 2))
