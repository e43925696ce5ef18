"""A constrained request that migrates tells the next node how many tokens to replay."""

from __future__ import annotations

from mlxcel_plugin.engine_api import GenerationRequest, SamplingParams
from router_plugin.cluster.migration import MigrationLedger

SPEC = '{"name":null,"schema":null,"strict":false,"type":"json_object"}'


def test_the_streamed_tokens_are_replayed_into_the_grammar() -> None:
    ledger = MigrationLedger(GenerationRequest("r", (1, 2, 3), 10, SamplingParams(grammar=SPEC)))
    ledger.record([4, 5])
    moved = ledger.next_request()
    assert moved.prompt_tokens == (1, 2, 3, 4, 5)
    assert moved.sampling.grammar == SPEC and moved.sampling.grammar_replay_tokens == 2
    ledger.record([6])  # it moves again: all three streamed tokens are the grammar's
    assert ledger.next_request().sampling.grammar_replay_tokens == 3


def test_an_unconstrained_request_keeps_its_sampling() -> None:
    request = GenerationRequest("r", (1, 2), 10, SamplingParams(seed=4))
    ledger = MigrationLedger(request)
    ledger.record([3])
    assert ledger.next_request().sampling is request.sampling
