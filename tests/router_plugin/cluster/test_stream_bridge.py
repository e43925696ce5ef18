from __future__ import annotations

import itertools

import pytest

from mlxcel_plugin.engine_api import FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP
from router_plugin.cluster.stream_bridge import (
    DECODE,
    PREFILL,
    BridgeOutput,
    BridgeState,
    ResultEvent,
    StreamBridge,
)

FIRST = ResultEvent(PREFILL, 0, (10,))
D1 = ResultEvent(DECODE, 1, (11,))
D2 = ResultEvent(DECODE, 2, (12, 13))
D4_END = ResultEvent(DECODE, 4, (14,), finish_reason=FINISH_STOP)


def feed_all(bridge: StreamBridge, events) -> list[BridgeOutput]:
    return [out for event in events for out in bridge.feed(event)]


def tokens(outputs) -> list[int]:
    return [token for out in outputs for token in out.token_ids]


def test_in_order_stream_walks_the_four_states():
    bridge = StreamBridge()
    assert bridge.state is BridgeState.WAITING_FOR_PREFILL
    assert bridge.feed(FIRST) == [BridgeOutput((10,))]
    assert bridge.state is BridgeState.HANDOFF_TO_DECODE
    assert bridge.feed(D1) == [BridgeOutput((11,))]
    assert bridge.state is BridgeState.DECODING
    assert bridge.feed(D2) == [BridgeOutput((12, 13))]
    assert bridge.feed(D4_END) == [BridgeOutput((14,), FINISH_STOP)]
    assert (bridge.state, bridge.finish_reason, bridge.tokens_emitted) == (
        BridgeState.COMPLETE,
        FINISH_STOP,
        5,
    )


@pytest.mark.parametrize("order", list(itertools.permutations([FIRST, D1, D2, D4_END])))
def test_any_arrival_order_gives_the_same_stream_with_one_terminal(order):
    bridge = StreamBridge()
    outputs = feed_all(bridge, order)
    assert tokens(outputs) == [10, 11, 12, 13, 14]
    assert [out.finish_reason for out in outputs if out.terminal] == [FINISH_STOP]
    assert outputs[-1].terminal


def test_decode_tokens_before_the_first_token_wait_for_it():
    bridge = StreamBridge()
    assert bridge.feed(D1) == []
    assert bridge.feed(D2) == []
    assert bridge.state is BridgeState.WAITING_FOR_PREFILL
    assert bridge.feed(FIRST) == [
        BridgeOutput((10,)),
        BridgeOutput((11,)),
        BridgeOutput((12, 13)),
    ]
    assert bridge.state is BridgeState.DECODING


def test_repeated_and_overlapping_events_are_not_duplicated():
    bridge = StreamBridge()
    outputs = feed_all(
        bridge,
        [FIRST, FIRST, D1, ResultEvent(DECODE, 1, (11, 12)), D2, D2, D1],
    )
    assert tokens(outputs) == [10, 11, 12, 13]
    # A repeat of an event still waiting in the buffer is dropped too.
    later = StreamBridge()
    assert feed_all(later, [D2, D2, FIRST, D1]) == [
        BridgeOutput((10,)),
        BridgeOutput((11,)),
        BridgeOutput((12, 13)),
    ]


def test_first_token_that_ends_the_request_completes_from_prefill():
    bridge = StreamBridge()
    end = ResultEvent(PREFILL, 0, (2,), finish_reason=FINISH_LENGTH)
    assert bridge.feed(end) == [BridgeOutput((2,), FINISH_LENGTH)]
    assert bridge.complete
    assert bridge.feed(D1) == []


def test_events_after_complete_are_ignored():
    bridge = StreamBridge()
    feed_all(bridge, [FIRST, D1, ResultEvent(DECODE, 2, (), finish_reason=FINISH_STOP)])
    assert bridge.feed(D2) == []
    assert bridge.feed(ResultEvent(DECODE, 3, (), error="late")) == []
    assert bridge.node_lost(DECODE) == []
    assert bridge.finish(FINISH_CANCELLED) == []
    assert bridge.finish_reason == FINISH_STOP


@pytest.mark.parametrize("source", [PREFILL, DECODE])
def test_an_error_from_either_side_ends_at_once_with_one_error_terminal(source):
    bridge = StreamBridge()
    bridge.feed(FIRST)
    bridge.feed(D2)  # buffered, never released
    failed = bridge.feed(ResultEvent(source, 5, (), error="engine exploded"))
    assert failed == [BridgeOutput((), FINISH_ERROR, "engine exploded")]
    assert bridge.feed(D1) == []
    assert (bridge.error, bridge.tokens_emitted) == ("engine exploded", 1)


def test_an_error_finish_reason_without_a_message_still_ends_as_error():
    bridge = StreamBridge()
    outputs = bridge.feed(ResultEvent(DECODE, 3, (), finish_reason=FINISH_ERROR))
    assert outputs == [BridgeOutput((), FINISH_ERROR, "decode node failed")]


def test_node_lost_ends_with_an_error_unless_complete():
    bridge = StreamBridge()
    bridge.feed(FIRST)
    assert bridge.node_lost(DECODE) == [BridgeOutput((), FINISH_ERROR, "decode node lost")]
    assert bridge.node_lost(PREFILL) == []


def test_losing_prefill_while_waiting_or_handing_off_is_an_error():
    waiting = StreamBridge()
    assert waiting.node_lost(PREFILL)[0].error == "prefill node lost"
    handing_off = StreamBridge()
    handing_off.feed(FIRST)
    assert handing_off.node_lost(PREFILL)[0].finish_reason == FINISH_ERROR


def test_losing_prefill_once_decode_tokens_flow_changes_nothing():
    bridge = StreamBridge()
    feed_all(bridge, [FIRST, D1])
    assert bridge.node_lost(PREFILL) == []
    assert bridge.feed(D2) == [BridgeOutput((12, 13))]


def test_reorder_buffer_is_bounded():
    bridge = StreamBridge(max_buffered_events=2)
    assert feed_all(bridge, [D1, D2]) == []
    overflow = bridge.feed(D4_END)
    assert overflow == [BridgeOutput((), FINISH_ERROR, "result stream reorder buffer overflow")]


def test_router_ends_the_stream_itself_exactly_once():
    bridge = StreamBridge()
    feed_all(bridge, [FIRST, D1])
    assert bridge.finish(FINISH_LENGTH) == [BridgeOutput((), FINISH_LENGTH)]
    assert bridge.feed(D2) == []
    assert bridge.finish(FINISH_LENGTH) == []


def test_reroute_only_before_the_first_token_and_old_attempt_events_are_dropped():
    bridge = StreamBridge()
    bridge.feed(D1)  # from the first attempt's decode node, buffered
    assert bridge.can_reroute and not bridge.emitted_any_token
    assert bridge.restart() == 1
    assert bridge.feed(FIRST) == []  # attempt 0: stale
    first = ResultEvent(PREFILL, 0, (20,), attempt=1)
    assert bridge.feed(first) == [BridgeOutput((20,))]  # the stale D1 was dropped
    assert bridge.emitted_any_token and not bridge.can_reroute
    with pytest.raises(RuntimeError):
        bridge.restart()


def test_resume_numbers_the_new_attempt_after_the_tokens_already_released():
    bridge = StreamBridge()
    feed_all(bridge, [FIRST, D1])  # tokens at completion index 0 and 1
    early = ResultEvent(DECODE, 1, (31,), attempt=1)
    assert bridge.resume() == 1 and bridge.seq_base == 2
    assert not bridge.attempt_started
    assert bridge.feed(D2) == []  # attempt 0: stale
    assert bridge.feed(early) == []  # the new attempt's seq 1 waits for its seq 0
    assert bridge.feed(ResultEvent(PREFILL, 0, (30,), attempt=1)) == [
        BridgeOutput((30,)), BridgeOutput((31,))]
    assert bridge.attempt_started and bridge.next_seq == 4
    # A repeat of the new attempt's seq 0 is a duplicate, like any other.
    assert bridge.feed(ResultEvent(PREFILL, 0, (30,), attempt=1)) == []
    end = ResultEvent(DECODE, 2, (32,), FINISH_LENGTH, attempt=1)
    assert bridge.feed(end) == [BridgeOutput((32,), FINISH_LENGTH)]
    with pytest.raises(RuntimeError):
        bridge.resume()
