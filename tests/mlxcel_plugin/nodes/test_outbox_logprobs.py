"""Outbox: queued results of a request merge with their logprobs, in order."""

from __future__ import annotations

import asyncio

from mlxcel_plugin.engine_api import TokenEvent
from mlxcel_plugin.logprobs import TokenLogprobs
from mlxcel_plugin.nodes.outbox import Outbox, token_result
from tests.mlxcel_plugin.nodes.test_outbox import drained, sent


def lp(value: float) -> TokenLogprobs:
    return TokenLogprobs(value, (1,), (-0.5,))


def test_merged_results_keep_one_logprob_per_token() -> None:
    def put(outbox: Outbox) -> None:
        outbox.put_result(token_result(TokenEvent("a", 1, 10, logprobs=lp(-1.0))))
        outbox.put_result(token_result(TokenEvent("a", 2, 11, logprobs=lp(-2.0))))
        outbox.put_result(token_result(TokenEvent("a", 3, 12, "length", logprobs=lp(-3.0))))

    link = asyncio.run(drained(put))
    first, merged = sent(link)
    assert first.logprobs == (lp(-1.0),)
    assert merged.token_ids == [11, 12] and merged.logprobs == (lp(-2.0), lp(-3.0))
    assert merged.finish_reason == "length"


def test_a_terminal_event_without_a_token_has_no_logprobs() -> None:
    result = token_result(TokenEvent("a", 4, None, "cancelled"))
    assert result.token_ids == [] and result.logprobs == ()
