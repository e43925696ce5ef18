"""What a REQUEST frame may carry: a node refuses the rest by name, a router cannot encode it."""

from __future__ import annotations

import math

import pytest

from mlxcel_plugin.link.protocol.frame_codec import encode_header
from mlxcel_plugin.link.protocol.frames import (
    Frame,
    FrameType,
    MalformedFrame,
    Request,
    pack_token_ids,
)


def arriving(**header) -> Frame:
    return Frame(FrameType.REQUEST, {"request_id": "r", **header}, pack_token_ids([1, 2]))


@pytest.mark.parametrize("header, code", [
    ({"sampling": {"temperature": math.nan}}, "frame_field_out_of_range"),
    ({"sampling": {"temperature": math.inf}}, "frame_field_out_of_range"),
    ({"sampling": {"min_p": math.nan}}, "frame_field_out_of_range"),
    ({"sampling": {"top_p": -math.inf}}, "frame_field_out_of_range"),
    ({"sampling": {"top_p": 1.5}}, "frame_field_out_of_range"),
    ({"sampling": {"temperature": -1.0}}, "frame_field_out_of_range"),
    ({"sampling": {"top_k": -1}}, "frame_field_out_of_range"),
    ({"sampling": {"seed": 2**63}}, "frame_field_out_of_range"),
    ({"sampling": {"seed": 1.5}}, "frame_malformed"),
    ({"sampling": {"temperature": "hot"}}, "frame_malformed"),
    ({"sampling": {1: 2}}, "frame_malformed"),
    ({"max_tokens": 2**63}, "frame_field_out_of_range"),
    ({"max_tokens": -1}, "frame_field_out_of_range"),
    ({"stop_token_ids": [2**32]}, "frame_field_out_of_range"),
    ({"stop_token_ids": [-1]}, "frame_field_out_of_range"),
    ({"deadline_unix_s": math.nan}, "frame_field_out_of_range"),
    ({"request_id": ""}, "frame_malformed"),
    ({"request_id": "x" * 257}, "frame_malformed"),
    ({"decode_target": "10.0.0.1:9000 "}, "decode_target_malformed"),
    ({"decode_target": "10.0.0.1"}, "decode_target_malformed"),
])
def test_a_node_refuses_out_of_range_fields_by_name(header, code):
    with pytest.raises(MalformedFrame) as caught:
        Request.from_frame(arriving(**header))
    assert caught.value.code == code


def test_in_range_fields_pass_and_the_target_is_canonical():
    request = Request.from_frame(arriving(
        sampling={"temperature": 2, "top_p": 1.0, "min_p": 0.0, "top_k": 0, "seed": -(2**63),
                  "some_newer_field": math.nan},  # unknown keys are not the node's business
        max_tokens=2**63 - 1, stop_token_ids=[0, 2**32 - 1], decode_target="Decode.Local:0900"))
    assert request.decode_target == "decode.local:900"
    assert request.sampling["seed"] == -(2**63)


@pytest.mark.parametrize("request_", [
    Request("r", [1], {"seed": 10**30}),
    Request("r", [1], {"seed": -(2**70)}),
    Request("r", [1], {"top_k": 10**30}),
    Request("r", [1], {"temperature": math.nan}),
    Request("r", [1], max_tokens=2**64),
    Request("r", [1], decode_target=" 10.0.0.1:1"),
])
def test_a_router_cannot_encode_what_a_node_would_refuse(request_):
    with pytest.raises(MalformedFrame) as caught:
        request_.to_frame()
    assert caught.value.code in ("frame_field_out_of_range", "decode_target_malformed")


def test_the_codec_names_the_integer_it_cannot_carry():
    with pytest.raises(MalformedFrame, match=r"'sampling\.seed'") as caught:
        encode_header(FrameType.RESULT, {"sampling": {"seed": 10**30}})
    assert caught.value.code == "frame_field_out_of_range"
    with pytest.raises(MalformedFrame, match=r"'token_ids\[1\]'"):
        encode_header(FrameType.RESULT, {"token_ids": [1, -(2**64)]})
