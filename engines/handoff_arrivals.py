"""When a handed-off sequence joins the running batch, and when its prompt is cached.

Why: adopting a handoff (checks, rebuilding its caches), the prefix cache's copy
of its prompt, and the new sequence's first forward (a group of its own, over its
whole prompt: about as long as a plain step again) all ran in one loop iteration,
so every running stream's gap across it was about twice a plain step; one such
gap per handoff is what set bench_decode_isolation's p99. While sequences
decode, the engine now spreads that work over its iterations: the adoption (in
the iteration whose commands bring the handoff), then the join and first forward
(the next iteration), then the prefix store (after the sequence's step ends it,
or after the next step with no adoption and no join). With nothing decoding
there is no stream to protect: everything runs at once.

A store may wait: decoding writes only past the prompt, so the stored positions
read the same later; once the sequence has decoded in place, its buffers are its
own and the store shares them instead of copying (``decoded_in_place``). Stores
wait at most ``MAX_WAITING_STORES`` deep, and all of them run before a prefill,
which may look their prompts up.

A long sequence that would open a group of its own while others decode does not
join at once: its first forward runs a slice of the model's layers after each of
the next steps (engines/sliced_join.py), then joins with that forward's output, so
the step after only takes its row through the batch's shared vocabulary head.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from mlx_lm.models.cache import KVCache

from engines.decode_batch import DecodeBatch, Sequence
from engines.prefix.cache import SHARE_MIN_BYTES
from engines.sliced_join import SlicedJoins

Waiting = tuple[Sequence, list[Any]]  # a sequence and its caches, waiting to join

# Past this many prompt caches waiting for the prefix cache, one is stored even
# in an iteration that has a join.
MAX_WAITING_STORES = 8

# (request id, prefix cache, tokens, caches)
PromptStore = tuple[str, Any, tuple[int, ...], list[Any]]


class HandoffArrivals:
    """The engine thread's pacing of arrival work (engine thread only)."""

    def __init__(self, fit: Callable[[], None], sliced: SlicedJoins | None = None):
        self._fit = fit  # evicts cached prefixes past the engine's KV budget
        self._sliced = sliced  # None: every sequence's first forward is a whole step
        self._adopted_now = False  # a handoff was adopted in this iteration while decoding
        self._joined = False  # sequences joined the batch in this iteration
        self._stores: deque[PromptStore] = deque()

    def __bool__(self) -> bool:
        """Work left to do (the engine loop keeps turning while there is)."""
        return bool(self._stores)

    def adopted(self, decoding: bool) -> None:
        """A handoff was adopted into the waiting queue (``decoding``: the batch is running;
        if not, its prompt is stored at once: no stream to protect)."""
        self._adopted_now = self._adopted_now or decoding
        if not decoding:
            self.flush()

    def admit(self, waiting: deque[Waiting], batch: DecodeBatch, max_batch_size: int) -> bool:
        """Waiting sequences join ``batch``, room allowing, except in an iteration that
        adopted a handoff (they join a step later); whether any did. One that would open a
        group of its own while others decode begins its sliced first forward instead, and
        stays in ``waiting`` (counted, cancellable) until ``first_forwards`` ends it."""
        sliced = self._sliced
        room = max_batch_size - len(batch) - len(sliced or ()) if not self._adopted_now else 0
        joining, staying = [], deque()
        for sequence, caches in waiting:
            if room <= 0 or (sliced is not None and sequence.request_id in sliced):
                staying.append((sequence, caches))
                continue
            room -= 1
            if self._slices(batch, sequence, caches):
                sliced.begin(sequence, caches)
                staying.append((sequence, caches))
            else:
                joining.append((sequence, caches))
        waiting.clear()
        waiting.extend(staying)
        if joining:
            batch.add([s for s, _ in joining], [c for _, c in joining])
        self._joined = bool(joining)
        return self._joined

    def _slices(self, batch: DecodeBatch, sequence: Sequence, caches: list[Any]) -> bool:
        """Whether this sequence's first forward is sliced: streams decode and it would be a
        forward of its own (engines/sliced_join.py)."""
        return (self._sliced is not None and len(batch) > 0 and self._sliced.takes(caches)
                and batch.opens_group(caches, sequence.steps_left))

    def first_forwards(self, waiting: deque[Waiting], batch: DecodeBatch) -> int:
        """One slice of each sliced first forward, after the step; a sequence whose last slice
        ran joins ``batch`` with its body output ready (the next step takes its token) and
        its prompt is stored."""
        if not self._sliced or self._adopted_now:  # an adoption's iteration: no slice too
            return 0
        # As a join: no prompt store in this iteration (nor a copy of caches half stepped:
        # a store after the join shares them).
        self._joined = True
        done = self._sliced.step({s.request_id for s, _ in waiting}, batch.before_group)
        ended = {forward.sequence.request_id for forward, _ in done}
        if ended:
            kept = [w for w in waiting if w[0].request_id not in ended]
            waiting.clear()
            waiting.extend(kept)
        for forward, output in done:
            batch.add([forward.sequence], [forward.caches], ready=output)
            # Its caches are its own now (decoded in place): shared, not copied. Stored here,
            # the store stays out of the next step, which takes its token and may end it.
            self.store_now(forward.sequence.request_id)
        return len(done)

    def store_later(self, request_id: str, prefix: Any, tokens: tuple[int, ...],
                    caches: list[Any]) -> None:
        """``prefix.store_received(tokens, caches)`` in a later iteration (``prefix``: the
        cache the handoff was adopted under; engines/lora keys it by adapter)."""
        self._stores.append((request_id, prefix, tokens, caches))

    def after_step(self, batch: DecodeBatch, waiting: Iterable[Waiting]) -> int:
        """The stores this iteration may run, after its step; how many ran.

        A store whose sequence left ``batch`` and ``waiting`` runs now (its next turn may
        look its prompt up); one more runs in an iteration that adopted and joined
        nothing; every one when nothing decodes.
        """
        quiet = not (self._adopted_now or self._joined)
        self._adopted_now = self._joined = False
        if not self._stores:
            return 0
        running = {s.request_id for s in batch.sequences} | {s.request_id for s, _ in waiting}
        ended = [s for s in self._stores if s[0] not in running]
        pending = [s for s in self._stores if s[0] in running]
        extra = len(pending) if not running else int(quiet or len(pending) > MAX_WAITING_STORES)
        self._stores = deque(pending[extra:])
        return self._run([*ended, *pending[:extra]])

    def store_now(self, request_id: str) -> int:
        """The store of ``request_id`` now, if it waits (its sequence is ending)."""
        mine = [s for s in self._stores if s[0] == request_id]
        if mine:
            self._stores = deque(s for s in self._stores if s[0] != request_id)
        return self._run(mine)

    def flush(self) -> int:
        """Every store now (before a prefill, which may look the prompts up)."""
        stores, self._stores = list(self._stores), deque()
        return self._run(stores)

    def _run(self, stores: list[PromptStore]) -> int:
        for _, prefix, tokens, caches in stores:
            share = 0 if decoded_in_place(caches, len(tokens)) else SHARE_MIN_BYTES
            prefix.store_received(tokens, caches, share_min_bytes=share)
        if stores:
            self._fit()
        return len(stores)


def decoded_in_place(caches: list[Any], prompt_tokens: int) -> bool:
    """Whether the sequence has decoded into these very caches (a group of its own): their
    buffers are then its own, so the prefix cache may share them instead of copying.

    Why own: a small handoff lands in views of the receiver's shared 64 MiB slabs
    (engines/unfilled.py), which the prefix cache copies out of rather than pin; MLX
    writes in place only into memory no other array shares, so the first step's
    write already copied each such buffer (a large one is its own allocation anyway).
    Caches merged into a batch group were copied instead and are never written.
    """
    return all(type(c) is KVCache and c.offset > prompt_tokens for c in caches)
