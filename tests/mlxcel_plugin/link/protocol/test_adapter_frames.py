"""Adapter fields on the link: REQUEST's adapter, TELEMETRY's announce, ADAPTER commands."""

from __future__ import annotations

import pytest

from mlxcel_plugin.link.protocol.frames import (
    AdapterCommand,
    Frame,
    FrameType,
    MalformedFrame,
    Request,
    Telemetry,
    decode_frame,
    encode_frame,
    parse_typed,
)


def round_trip(frame: Frame) -> object:
    return parse_typed(decode_frame(encode_frame(frame)))


def test_request_carries_the_adapter_and_a_base_request_keeps_its_bytes():
    base = Request("r1", [1, 2, 3])
    assert "adapter" not in base.to_frame().header
    adapted = Request("r1", [1, 2, 3], adapter="sql", adapter_digest="abc")
    assert round_trip(adapted.to_frame()) == adapted


def test_telemetry_announces_adapters():
    plain = Telemetry("d1", "decode")
    assert "adapters" not in plain.to_frame().header
    announced = Telemetry("d1", "decode", adapters={"sql": "abc", "chat": "def"})
    assert round_trip(announced.to_frame()).adapters == {"sql": "abc", "chat": "def"}


@pytest.mark.parametrize("adapters", [{"sql": 3}, {"x" * 300: "d"}, "sql"])
def test_a_malformed_announce_is_refused_by_name(adapters):
    frame = Telemetry("d1", "decode").to_frame()
    frame.header["adapters"] = adapters
    with pytest.raises(MalformedFrame):
        Telemetry.from_frame(frame)


def test_adapter_command_and_its_replies():
    load = AdapterCommand("c1", "load", "sql", lora_path="/adapters/sql")
    assert round_trip(load.to_frame()) == load
    done = round_trip(load.reply(digest="abc").to_frame())
    assert (done.op, done.digest, done.command_id) == ("done", "abc", "c1")
    failed = round_trip(load.reply(error="no such directory", code="invalid_request").to_frame())
    assert (failed.op, failed.error, failed.code) == ("failed", "no such directory",
                                                      "invalid_request")


def test_an_unknown_op_is_refused():
    with pytest.raises(MalformedFrame, match="op"):
        AdapterCommand.from_frame(Frame(FrameType.ADAPTER, {"command_id": "c", "op": "fuse",
                                                            "lora_name": "sql"}))
