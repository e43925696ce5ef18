"""The pure parts of mid-stream migration: the ledger, which failures move, who stalled."""

from __future__ import annotations

import asyncio

from mlxcel_plugin.engine_api import GenerationRequest, SamplingParams
from router_plugin.cluster.migration import (
    TOKEN_TIMEOUT_CODE,
    MigrationLedger,
    moves_request,
    next_batch_within,
    stall_event,
)
from router_plugin.cluster.peer_links import PeerEvent
from router_plugin.cluster.stream_bridge import DECODE, PREFILL

SEEDED = GenerationRequest("r", (5, 6, 7), 10, SamplingParams(temperature=0.8, seed=3),
                           stop_token_ids=(2,))


def test_the_next_request_continues_the_prompt_with_the_budget_left():
    ledger = MigrationLedger(SEEDED, max_migrations=2)
    ledger.record((40, 41))
    ledger.record(())
    ledger.record((42,))
    moved = ledger.next_request()
    assert moved.prompt_tokens == (5, 6, 7, 40, 41, 42)
    assert moved.max_tokens == 7
    # Same id, sampling (seed) and stop ids: only the prompt and the budget change.
    assert (moved.request_id, moved.sampling, moved.stop_token_ids) == ("r", SEEDED.sampling,
                                                                         (2,))
    ledger.record((43,))
    # Always built from the client's request, not from the previous move.
    assert ledger.next_request().prompt_tokens == (5, 6, 7, 40, 41, 42, 43)
    assert ledger.migrations == 2 and not ledger.can_migrate


def test_a_moved_request_does_not_ask_for_prompt_logprobs_again():
    """They came with the first token; the new prefill would recompute them uncached."""
    asked = GenerationRequest("r", (5, 6, 7), 10, SamplingParams(logprobs=2, prompt_logprobs=2))
    ledger = MigrationLedger(asked)
    ledger.record((40,))
    moved = ledger.next_request()
    assert moved.sampling.prompt_logprobs is None and moved.sampling.logprobs == 2


def test_no_migration_without_budget_or_with_a_zero_limit():
    spent = MigrationLedger(SEEDED)
    spent.record(range(10))
    assert spent.remaining_tokens == 0 and not spent.can_migrate
    assert not MigrationLedger(SEEDED, max_migrations=0).can_migrate


def test_node_failures_move_a_request_client_faults_do_not():
    client_codes = {"invalid_request"}
    assert moves_request(PeerEvent(DECODE, "d0", error="gone", lost=True), client_codes)
    assert moves_request(PeerEvent(DECODE, "d0", error="boom", code="engine_error"),
                         client_codes)
    assert moves_request(PeerEvent(PREFILL, "p0", error="handoff failed"), client_codes)
    assert not moves_request(PeerEvent(DECODE, "d0", error="bad", code="invalid_request"),
                             client_codes)


def test_a_stall_is_the_decode_nodes_failure():
    stall = stall_event("d1", timeout_s=2.0)
    assert (stall.source, stall.node_id) == (DECODE, "d1")
    assert stall.code == TOKEN_TIMEOUT_CODE and not stall.lost
    assert "within 2 s" in stall.error


def test_next_batch_within_returns_none_on_silence_and_the_batch_otherwise():
    async def main():
        queue: asyncio.Queue[int] = asyncio.Queue()
        assert await next_batch_within(queue, 0.01) is None
        queue.put_nowait(1)
        queue.put_nowait(2)
        assert await next_batch_within(queue, 5.0) == [1, 2]
        queue.put_nowait(3)
        assert await next_batch_within(queue, None) == [3]

    asyncio.run(asyncio.wait_for(main(), 10))
