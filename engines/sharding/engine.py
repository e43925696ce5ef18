"""``MlxEngine`` over tensor-parallel ranks: the leader serves, followers run its steps.

Both are the engine's own loop (engines/mlx_engine.py) with the few points
where ranks meet overridden: the leader broadcasts each command it takes,
each prefill's first token and each step's tokens (engines/sharding/protocol.py);
a follower takes its commands and tokens from there instead of a queue and
a sampler, so every rank builds the same batches and runs the same forwards
(mlx-lm's sharded layers all-reduce inside them).

The leader's callbacks never fail from the loop's point of view: a consumer
that raises is cancelled through the command queue, which every rank then
sees (a dropped request on the leader alone would split the ranks' batches).
Handoffs carry whole K/V (engines/sharding/group.py). ``ShardedEngine`` is what a
node holds: the leader, described by the unsharded model's fingerprint. It
offers no ``reserve_prefix``, so decode nodes take full handoffs, no deltas
(a pin taken off the engine thread would be the leader's alone).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engines.engine_commands import Cancel, Decode, Generate, Prefill, finish_command
from engines.mlx_engine import MlxEngine
from engines.prefill import Prefilled
from engines.sharding.group import gather_layer, split_state
from engines.sharding.protocol import (
    ShardDiverged,
    receive,
    receive_step,
    receive_tokens,
    send_command,
    send_end,
    send_failed,
    send_tokens,
)
from mlxcel_plugin.engine_api import (
    FINISH_ERROR,
    CacheState,
    EngineConfig,
    GenerationRequest,
    ModelInfo,
    PrefillResult,
)
from mlxcel_plugin.errors import EngineError, HandoffError

log = logging.getLogger(__name__)
Group = mx.distributed.Group
Command = Generate | Prefill | Decode | Cancel


class _RankEngine(MlxEngine):
    """What every rank shares: its place in the group; a decode keeps this rank's KV heads."""

    streams_prefill_rows = False  # a rank's rows hold its heads only: layers go gathered

    def __init__(self, model: nn.Module, info: ModelInfo, config: EngineConfig, group: Group):
        # Whole-chunk reuse: the start-up probe's forwards could end differently per rank.
        whole = dataclasses.replace(config.prefix_cache, granularity="chunk")
        super().__init__(model, info, dataclasses.replace(config, prefix_cache=whole))
        self.group = group

    def _apply_local(self, command: Command) -> None:
        if isinstance(command, Decode):
            try:
                own = split_state(command.cache, self.group.rank(), self.group.size())
            except HandoffError as exc:  # the same on every rank: each drops it
                finish_command(command, FINISH_ERROR, exc)
                return
            command = dataclasses.replace(command, cache=own)
        super()._apply(command)


class LeaderEngine(_RankEngine):
    """Rank 0: the engine the node talks to; it tells the followers what to run."""

    def __init__(self, model: nn.Module, info: ModelInfo, config: EngineConfig, group: Group):
        super().__init__(model, info, config, group)
        self._step_tokens: list[int] = []
        self._quiet = False  # promised the followers: no commands this iteration

    def _serve(self) -> None:
        try:
            super()._serve()
        except RuntimeError as exc:  # mlx's ring: "[ring] connection to a peer was lost"
            # Without every rank no forward can run: exit, so routers see the node gone.
            log.critical("shard ring broken (%s); this node exits", exc)
            os._exit(1)

    def _handle_commands(self) -> bool:
        if self._quiet:
            self._quiet = False
            return True
        going = super()._handle_commands()
        send_end(self.group, going)
        return going

    def _apply(self, command: Command) -> None:
        command = self._guarded(command)
        send_command(self.group, command)
        self._apply_local(command)

    def _prefill_request(self, request: GenerationRequest, on_layer: Any = None,
                         on_rows: Any = None) -> Prefilled:
        try:
            done = super()._prefill_request(request, on_layer)  # a rank holds some heads only
        except Exception:
            send_failed(self.group)
            raise
        send_tokens(self.group, [done.token])
        return done

    def _decode_step(self) -> None:
        if not len(self._batch):
            return
        self._step_tokens = []
        super()._decode_step()
        self._quiet = self._commands.empty() and self._has_work()
        # [] when the step failed; the row cost: the followers propose as this rank does
        send_tokens(self.group, self._step_tokens, self._quiet, self._batch.cost.row_cost)

    def _advance(self, sequence: Any, logits: np.ndarray) -> bool:
        going = super()._advance(sequence, logits)
        self._step_tokens.append(sequence.last_token)
        return going

    # -- callbacks that cannot split the ranks --------------------------------------

    def _guarded(self, command: Command) -> Command:
        if isinstance(command, Cancel):
            return command
        if isinstance(command, Prefill):
            return self._gathering(command)
        emit = self._emit_or_cancel(command.request.request_id, command.emit)
        return dataclasses.replace(command, emit=emit)

    def _emit_or_cancel(self, request_id: str, emit: Any) -> Any:
        failed = False

        def guarded(event: Any) -> None:
            nonlocal failed
            if failed:
                return
            try:
                emit(event)
            except Exception:
                failed = True
                log.exception("token consumer of %s failed; cancelling it on every rank",
                              request_id)
                self._commands.put(Cancel(request_id))

        return guarded

    def _gathering(self, command: Prefill) -> Prefill:
        """Each layer gathered from every rank as it is ready; the result holds whole K/V."""
        whole: list[Any] = []
        problems: list[Exception] = []

        def on_layer(index: int, layer: Any) -> None:
            whole.append(gather_layer(self.group, layer))
            if command.on_layer is not None and not problems:
                try:
                    command.on_layer(index, whole[-1])
                except Exception as exc:  # the prefill goes on: the followers are in it too
                    problems.append(exc)

        def on_done(result: Any) -> None:
            if isinstance(result, PrefillResult):
                result = problems[0] if problems else dataclasses.replace(
                    result, cache=CacheState(whole))
            command.on_done(result)

        return Prefill(command.request, on_done, on_layer)


def _ignore(*_: Any) -> None:
    """A follower's callbacks: the leader answers the node."""


class _LeaderTokens:
    """A follower's sampler for one step: the tokens the leader sampled, in batch order."""

    def __init__(self, group: Group):
        self._group = group
        self._tokens: list[int] | None = None
        self._next = 0
        self.quiet = False
        self.row_cost: float | None = None  # the leader's, for the next step

    def take(self) -> list[int]:
        if self._tokens is None:
            step = receive_step(self._group)
            self._tokens, self.quiet, self.row_cost = step.tokens or [], step.quiet, step.row_cost
        return self._tokens

    def sample(self, _logits: np.ndarray, _position: int) -> int:
        tokens = self.take()
        if self._next >= len(tokens):
            raise ShardDiverged("the leader's step has fewer tokens than this rank's batch")
        self._next += 1
        return tokens[self._next - 1]

    def observe(self, _token: int) -> None:
        """Penalty context lives in the leader's sampler."""

    def logprobs(self, _logits: np.ndarray, _token: int) -> None:
        """The leader reports logprobs; a follower emits nothing."""


class FollowerEngine(_RankEngine):
    """Rank 1..N-1: runs the leader's commands on its weight slice; serves nothing."""

    def __init__(self, model: nn.Module, info: ModelInfo, config: EngineConfig, group: Group):
        super().__init__(model, info, config, group)
        # Speculation's row cost: the leader's, from its first step (the prior) on.
        self._batch.cost.follow(config.speculative.verify_row_cost)
        self._diverged: ShardDiverged | None = None
        self._quiet = False  # the leader's last step said: no commands next iteration

    def serve_forever(self) -> None:
        """The engine loop on this thread, until the leader stops (or the ring breaks)."""
        self._run()

    def _handle_commands(self) -> bool:
        if self._diverged is not None:
            raise self._diverged
        if self._quiet:
            self._quiet = False
            return True
        while True:
            op, message = receive(self.group)
            if op == "end":
                return True
            if op == "stop":
                return False
            self._apply_local(self._command(op, message))

    def _command(self, op: str, message: dict[str, Any]) -> Command:
        if op == "cancel":
            return Cancel(message["request_id"])
        request = message["request"]
        if op == "generate":
            return Generate(request, _ignore)
        if op == "prefill":
            return Prefill(request, _ignore, lambda _, layer: gather_layer(self.group, layer))
        if op == "decode":
            return Decode(request, int(message["first_token"]), message["cache"], _ignore)
        raise ShardDiverged(f"unknown message {op!r} from the leader")

    def _prefill_request(self, request: GenerationRequest, on_layer: Any = None,
                         on_rows: Any = None) -> Prefilled:
        try:
            done = super()._prefill_request(request, on_layer)  # a rank holds some heads only
        except Exception:
            if receive_tokens(self.group) is not None:  # the leader goes on with it: we cannot
                self._diverged = ShardDiverged(f"prefill of {request.request_id} failed here only")
            raise
        tokens = receive_tokens(self.group)
        if tokens is None:  # dropped on the leader: dropped here too (the base catches this)
            raise EngineError(f"prefill of {request.request_id} failed on the leader")
        done.token = tokens[0]
        return done

    def _decode_step(self) -> None:
        if not len(self._batch):
            return
        script = _LeaderTokens(self.group)
        for sequence in self._batch.sequences:
            sequence.sampler = script
        super()._decode_step()
        if len(script.take()) != script._next:
            raise ShardDiverged("the leader's step has more tokens than this rank's batch")
        self._quiet = script.quiet
        if script.row_cost is not None:  # its own timings would make other proposals
            self._batch.cost.follow(script.row_cost)
