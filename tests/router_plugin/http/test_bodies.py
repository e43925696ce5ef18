"""Response builders: the precomputed delta events equal the generic ones byte for byte."""

from __future__ import annotations

import pytest

from mlxcel_plugin.text import TextDelta, ToolCall
from router_plugin.http import bodies as responses
from router_plugin.http import sse

DELTAS = [
    TextDelta("a"),
    TextDelta(""),
    TextDelta('\u65e5\u672c "q" \\ \n\t\x00 \U0001f600'),
    TextDelta("", "thinking"),
    TextDelta("x", "y"),
    TextDelta("", "", [ToolCall(0, "call_0", "f", '{"a": "\u00e9"}')]),
]


@pytest.mark.parametrize("kind", [responses.CHAT, responses.TEXT])
@pytest.mark.parametrize("fingerprint", [None, 'fp "\u00e9\x00'])
def test_delta_events_equal_the_generic_event(kind: str, fingerprint: str | None) -> None:
    meta = responses.ResponseMeta(kind, "chatcmpl-\u00e9", 1700000000, 'm "x"', fingerprint)
    events = responses.DeltaEvents(meta)
    for delta in DELTAS:
        assert events.render(delta) == sse.event(responses.delta_chunk(meta, delta))
