"""Mid-stream migration: a request whose node failed after the client saw tokens moves on.

Its place in the whole path: docs/cluster-flow.md, "Migration".

Once the client has seen tokens a request can no longer start over, but it can
continue: the prompt plus the tokens already streamed become the prompt of a
new placement, with what is left of the ``max_tokens`` budget. The engines'
samplers are functions of the token sequence and of the absolute position
(``engines/sampling.py``: seeded draws come from ``(seed, position)``, and the
position of the next token is the length of that longer prompt), so a greedy or
seeded request continues with the tokens it would have produced; the front's
text pipeline (stop strings, stream filter, budget) sits above all of this and
keeps its state. What stays here is pure: the ledger of streamed tokens and
moves, which failures move a request, and the event a stall becomes.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TypeVar

from mlxcel_plugin.engine_api import FINISH_ERROR, GenerationRequest
from router_plugin.cluster.peer_links import PeerEvent
from router_plugin.cluster.stream_bridge import DECODE, PREFILL, BridgeState
from router_plugin.http.backend import next_batch

T = TypeVar("T")

DEFAULT_MAX_MIGRATIONS = 3
DEFAULT_TOKEN_TIMEOUT_S = 30.0
DEFAULT_MIGRATION_WAIT_S = 5.0
TOKEN_TIMEOUT_CODE = "token_timeout"


@dataclass
class MigrationLedger:
    """What one request has streamed to the client, and how often it moved."""

    request: GenerationRequest  # as the client asked for it
    max_migrations: int = DEFAULT_MAX_MIGRATIONS
    generated: list[int] = field(default_factory=list)  # tokens released, in order
    migrations: int = 0

    def record(self, token_ids: Collection[int]) -> None:
        self.generated.extend(token_ids)

    @property
    def remaining_tokens(self) -> int:
        return self.request.max_tokens - len(self.generated)

    @property
    def can_migrate(self) -> bool:
        return self.migrations < self.max_migrations and self.remaining_tokens > 0

    def next_request(self) -> GenerationRequest:
        """The request that continues the stream: prompt + streamed tokens, the budget left."""
        self.migrations += 1
        prompt = tuple(self.request.prompt_tokens) + tuple(self.generated)
        # A grammar's new matcher replays the streamed tokens (engines/grammar.py).
        sampling = self.request.sampling
        if sampling.grammar is not None:
            replay = sampling.grammar_replay_tokens + len(self.generated)
            sampling = dataclasses.replace(sampling, grammar_replay_tokens=replay)
        if sampling.prompt_logprobs is not None:  # sent with the first token already
            sampling = dataclasses.replace(sampling, prompt_logprobs=None)
        return dataclasses.replace(self.request, prompt_tokens=prompt, sampling=sampling,
                                   max_tokens=self.remaining_tokens)


def failed_result_as_error(event: PeerEvent) -> PeerEvent:
    """A RESULT that reports a failure (a handoff that never landed, an engine error) is
    handled like the node's ERROR frame: before the first token it ends the stream, after
    it the request migrates."""
    result = event.result
    if result is None or (result.finish_reason != FINISH_ERROR and result.error is None):
        return event
    return PeerEvent(event.source, event.node_id, error=result.error or f"{event.source} failed")


def moves_request(event: PeerEvent, client_error_codes: Collection[str]) -> bool:
    """Does this failure, after the client saw a token, call for a migration?

    A lost link, a stall, a node's error: the placement failed, not the request
    (it was valid when placed). A client-fault refusal would fail anywhere.
    """
    return event.lost or event.code not in client_error_codes


def is_refused_handoff(event: PeerEvent, state: BridgeState) -> bool:
    """Did the prefill node report that its KV did not land on the decode node?

    Once P's first token is out (``HANDOFF_TO_DECODE``), handing the KV to D is all P
    has left to do: its error then is D's refusal (or D lost, or no ack in time), by code.
    The request itself was fine: another pair takes it.
    """
    return event.source == PREFILL and not event.lost and state is BridgeState.HANDOFF_TO_DECODE


def stall_event(decode_node_id: str, timeout_s: float) -> PeerEvent:
    """No token within ``timeout_s`` of the last one: the decode node owes the next."""
    return PeerEvent(DECODE, decode_node_id,
                     error=f"no token from {decode_node_id} within {timeout_s:g} s",
                     code=TOKEN_TIMEOUT_CODE)


async def next_batch_within(queue: asyncio.Queue[T], timeout_s: float | None) -> list[T] | None:
    """``next_batch``, or None when nothing came within ``timeout_s`` (None: wait forever)."""
    if timeout_s is None:
        return await next_batch(queue)
    try:
        async with asyncio.timeout(timeout_s):
            return await next_batch(queue)
    except TimeoutError:
        return None
