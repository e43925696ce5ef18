"""Merge a request's prefill and decode result streams into one ordered stream.

Sans-I/O state machine, one per request on the router::

    WaitingForPrefill --first token--> HandoffToDecode --decode token--> Decoding
            |                                |                             |
            '----------- terminal, error, node lost ------------> Complete <'

The two results come over different links, so they can arrive in any order.
Guarantees, whatever the arrival order:

* no gap: events are released strictly by ``seq``; early ones wait in a
  bounded buffer (overflow ends the stream with an error);
* no duplicate: tokens at positions already released are dropped;
* exactly one terminal output: after it, everything is ignored;
* an error from either side ends the stream at once with one error terminal.

``seq`` is the completion index of an event's first token (0 = the first
token, which the prefill node samples; decode continues from 1), so a frame
may carry several tokens and the next expected ``seq`` is ``seq + len``.

A migrated request (docs/cluster-flow.md, "Migration") is a new attempt whose
nodes number from 0 again: ``resume`` sets ``seq_base`` to the tokens already
released, and each event of that attempt is read at ``seq + seq_base``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from mlxcel_plugin.engine_api import FINISH_ERROR, TokenEvent
from mlxcel_plugin.logprobs import PromptLogprobs, TokenLogprobs

PREFILL = "prefill"
DECODE = "decode"
DEFAULT_MAX_BUFFERED_EVENTS = 256


class BridgeState(StrEnum):
    WAITING_FOR_PREFILL = "waiting_for_prefill"
    HANDOFF_TO_DECODE = "handoff_to_decode"
    DECODING = "decoding"
    COMPLETE = "complete"


@dataclass(frozen=True)
class ResultEvent:
    """One result frame from a node, as the router received it."""

    source: str  # PREFILL or DECODE
    seq: int
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    error: str | None = None
    # The routing attempt it belongs to; events from an abandoned attempt are dropped.
    attempt: int = 0
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token id, when the request asked

    @property
    def end_seq(self) -> int:
        return self.seq + len(self.token_ids)


@dataclass(frozen=True)
class BridgeOutput:
    """What the router streams on: tokens, and on the last output the finish reason."""

    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token id, or none

    @property
    def terminal(self) -> bool:
        return self.finish_reason is not None


class StreamBridge:
    def __init__(self, *, max_buffered_events: int = DEFAULT_MAX_BUFFERED_EVENTS):
        self.max_buffered_events = max_buffered_events
        self.state = BridgeState.WAITING_FOR_PREFILL
        self.attempt = 0
        self.next_seq = 0
        self.seq_base = 0  # completion index of the current attempt's seq 0
        self.tokens_emitted = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self._early: dict[int, ResultEvent] = {}  # seq -> event that arrived before its turn

    @property
    def complete(self) -> bool:
        return self.state is BridgeState.COMPLETE

    @property
    def emitted_any_token(self) -> bool:
        return self.tokens_emitted > 0

    @property
    def can_reroute(self) -> bool:
        """Re-routing is only safe before the client has seen a token."""
        return not self.complete and not self.emitted_any_token

    def restart(self) -> int:
        """Start a new routing attempt; returns the attempt number to tag its events with."""
        if not self.can_reroute:
            raise RuntimeError("a stream can only be re-routed before its first token")
        return self._new_attempt()

    def resume(self) -> int:
        """Start a new attempt that continues after the tokens released so far (a migration)."""
        if self.complete:
            raise RuntimeError("a complete stream cannot be resumed")
        self.seq_base = self.next_seq
        return self._new_attempt()

    @property
    def attempt_started(self) -> bool:
        """Has the current attempt released a token (its seq 0 came)?"""
        return self.next_seq > self.seq_base

    def _new_attempt(self) -> int:
        self.attempt += 1
        self.state = BridgeState.WAITING_FOR_PREFILL
        self._early.clear()
        return self.attempt

    # --- input -------------------------------------------------------------------

    def feed(self, event: ResultEvent) -> list[BridgeOutput]:
        if self.complete or event.attempt != self.attempt:
            return []
        if event.error is not None or event.finish_reason == FINISH_ERROR:
            return self._end(FINISH_ERROR, event.error or f"{event.source} node failed")
        if self.seq_base:
            event = replace(event, seq=event.seq + self.seq_base)
        if event.seq > self.next_seq:
            return self._hold(event)
        outputs = self._release(event)
        while not self.complete and (early := self._pop_due()) is not None:
            outputs += self._release(early)
        return outputs

    def node_lost(self, source: str) -> list[BridgeOutput]:
        """A node serving this request went away.

        Losing the prefill node once decode tokens flow changes nothing: the
        decode node owns the sequence by then.
        """
        if source == PREFILL and self.state is BridgeState.DECODING:
            return []
        return self._end(FINISH_ERROR, f"{source} node lost")

    def finish(self, finish_reason: str, error: str | None = None) -> list[BridgeOutput]:
        """The router ends the stream itself (token budget, stop string, client gone)."""
        return self._end(finish_reason, error)

    # --- internals ---------------------------------------------------------------

    def _hold(self, event: ResultEvent) -> list[BridgeOutput]:
        if event.seq in self._early:
            return []  # a repeat of an event already waiting
        if len(self._early) >= self.max_buffered_events:
            return self._end(FINISH_ERROR, "result stream reorder buffer overflow")
        self._early[event.seq] = event
        return []

    def _pop_due(self) -> ResultEvent | None:
        due = [seq for seq in self._early if seq <= self.next_seq]
        return self._early.pop(min(due)) if due else None

    def _release(self, event: ResultEvent) -> list[BridgeOutput]:
        # Drop the part already released (a repeat, or an overlapping frame).
        released = max(0, self.next_seq - event.seq)
        fresh = event.token_ids[released:]
        if not fresh and event.finish_reason is None:
            return []
        self.next_seq += len(fresh)
        self.tokens_emitted += len(fresh)
        if event.finish_reason is not None:
            self._complete(event.finish_reason, None)
        else:
            self._advance(event.source)
        return [BridgeOutput(fresh, event.finish_reason, logprobs=event.logprobs[released:])]

    def _advance(self, source: str) -> None:
        if source == DECODE:
            self.state = BridgeState.DECODING
        elif self.state is BridgeState.WAITING_FOR_PREFILL:
            self.state = BridgeState.HANDOFF_TO_DECODE

    def _end(self, finish_reason: str, error: str | None) -> list[BridgeOutput]:
        if self.complete:
            return []
        self._complete(finish_reason, error)
        return [BridgeOutput((), finish_reason, error)]

    def _complete(self, finish_reason: str, error: str | None) -> None:
        self.state = BridgeState.COMPLETE
        self.finish_reason, self.error = finish_reason, error
        self._early.clear()


def token_events(request_id: str, index: int, output: BridgeOutput, cached_tokens: int,
                 prompt_logprobs: PromptLogprobs | None) -> list[TokenEvent]:
    """One ``TokenEvent`` per token of ``output`` from completion ``index`` (or its bare end).

    The first token of the completion (``index`` 0) brings what P said of the prompt.
    """
    if not output.token_ids:
        return [TokenEvent(request_id, index, None, output.finish_reason, output.error)]
    events = []
    last = len(output.token_ids) - 1
    for i, token_id in enumerate(output.token_ids):
        at, finish = index + i, output.finish_reason if i == last else None
        events.append(TokenEvent(
            request_id, at, token_id, finish, output.error if finish else None,
            0 if at else cached_tokens, output.logprobs[i] if output.logprobs else None,
            None if at else prompt_logprobs))
    return events
