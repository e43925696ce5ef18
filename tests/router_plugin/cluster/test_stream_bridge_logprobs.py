"""StreamBridge: logprobs stay with their tokens through repeats and reordering."""

from __future__ import annotations

from mlxcel_plugin.logprobs import TokenLogprobs
from router_plugin.cluster.stream_bridge import DECODE, PREFILL, ResultEvent, StreamBridge


def lp(i: int) -> TokenLogprobs:
    return TokenLogprobs(-float(i), (), ())


def test_overlapping_and_early_frames_release_each_tokens_logprobs_once() -> None:
    bridge = StreamBridge()
    early = bridge.feed(ResultEvent(DECODE, 2, (12, 13), logprobs=(lp(2), lp(3))))
    assert early == []
    out = bridge.feed(ResultEvent(PREFILL, 0, (10,), logprobs=(lp(0),)))
    out += bridge.feed(ResultEvent(DECODE, 1, (11, 12), logprobs=(lp(1), lp(2))))
    released = [(t, p) for o in out for t, p in zip(o.token_ids, o.logprobs, strict=True)]
    assert released == [(10, lp(0)), (11, lp(1)), (12, lp(2)), (13, lp(3))]


def test_frames_without_logprobs_release_none() -> None:
    out = StreamBridge().feed(ResultEvent(PREFILL, 0, (10,)))
    assert out[0].logprobs == ()
