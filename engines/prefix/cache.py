"""Prompt KV kept across requests, reused only where it is bit-exact.

``run_prefill`` computes a prompt in forwards that never cross the cells of
its ``PrefillGrid`` (``chunk_size_tokens`` from position 0), and a cell's K/V
depend only on the tokens up to its end. The cache stores what the grid says
any later prompt computes the same (``exact_end``: whole cells, and on an
any-token grid the partial last cell too) and a hit resumes where the grid
says the rest is computed the same (``usable``): output is byte-identical to
a cache-off run (engines/prefix/grid.py, docs/prefix-cache.md).

``reuse_generated`` also keeps what a sequence held when it finished (its
reply, computed by decode steps) and reuses any prefix of it, like
``mlx_lm.server``: far fewer tokens to prefill on the next chat turn, but not
byte-identical to a cache-off run.

Caches that cannot be cut back (SSM ``ArraysCache``, ``RotatingKVCache``, models
mixing them with attention) get exact-prefix *snapshots* instead, as mlx-lm
keeps for them: the state right after a prefill's last full chunk, reused
only by prompts that start with exactly those tokens (``snapshots``).

Storage, lookup and LRU eviction are mlx-lm's ``LRUPromptCache`` (a token trie).

Nothing here adds work before a request's first token that ``mlx_lm.server``
does not do: a hit reads the entry in place (fresh caches over views of its
arrays, copied once when the prefill first extends them, where mlx-lm
deep-copies and then grows the copy); a prefill's own store is queued
(``store_prompt_later``) and copied after its first token is out
(``store_pending``); a finished sequence's caches, and a prefill-only job's
(which nothing decodes), are adopted, not copied.

A decode node *pins* a stored prefix for a delta handoff (``pin``, from its
event loop): the request holds references to the entry's arrays, so an
eviction before the handoff completes cannot lose them; the engine splices
them in front of the received positions (``engines/prefix/splice.py``).
Pinned entries the LRU has dropped meanwhile still count in ``nbytes``.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, LRUPromptCache, make_prompt_cache, trim_prompt_cache

from engines.prefix.entries import compact_copy, reading, sharing, snapshot
from engines.prefix.grid import PrefillGrid
from mlxcel_plugin.engine_api import EngineConfig, PrefixCacheStats

log = logging.getLogger(__name__)

# LRUPromptCache keys entries by a model object; one engine holds one model.
_MODEL_KEY = "model"


def cacheable(caches: list[Any]) -> bool:
    """Only plain ``KVCache`` layers: rotating and recurrent state cannot be cut back exactly."""
    return all(type(c) is KVCache for c in caches)


# Handed-off caches at least this large are stored as views, not copies (the receive
# slabs of ``engines/unfilled.py`` are 64 MiB: a view pins at most a slab or two beyond it).
SHARE_MIN_BYTES = 64 << 20


@dataclass
class Lookup:
    caches: list[Any] | None  # fresh caches holding ``reused_tokens``, or None on a miss
    reused_tokens: int


@dataclass(frozen=True)
class Pin:
    """A request's hold on the first ``tokens`` positions of a stored entry's caches."""

    tokens: int
    caches: list[Any]  # the entry's own caches: never changed once stored
    entry_tokens: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)


class PrefixCache:
    """A byte-bounded LRU of prompt KV for one model, on the engine thread (pins: any thread)."""

    def __init__(self, max_bytes: int, chunk_size_tokens: int, reuse_generated: bool = False,
                 snapshots: bool = False):
        self.max_bytes = max_bytes
        # Whole cells until the start-up probe allows any token (engines/prefix/reuse_probe.py).
        self.grid = PrefillGrid(chunk_size_tokens)
        self.reuse_generated = reuse_generated
        self.snapshots = snapshots  # exact-prefix states only: the caches cannot be cut back
        self._lru = LRUPromptCache(max_size=1 << 30)
        self._lock = threading.Lock()  # the LRU and the pins: pins come from other threads
        self._pins: dict[str, Pin] = {}
        self._pending: list[tuple[tuple[int, ...], list[Any]]] = []  # engine thread only
        self._unlisted_pin_bytes = 0  # pinned entries the LRU dropped: still held
        self._hit_tokens = 0
        self._lookup_tokens = 0
        self._evictions = 0
        self._key: Hashable = _MODEL_KEY  # the trie's model key: the base's, or an adapter's
        self._views: dict[Hashable, PrefixCache] = {}

    @classmethod
    def for_model(cls, model: Any, config: EngineConfig) -> PrefixCache:
        """The engine's cache, inside its KV budget; snapshots for caches it cannot cut back."""
        settings = config.prefix_cache
        max_bytes = min(settings.max_bytes, config.kv_memory_bytes)
        snapshots = not cacheable(make_prompt_cache(model))
        if max_bytes > 0 and snapshots:
            log.info("prefix cache: exact-prefix snapshots (caches that cannot be cut back)")
        return cls(max_bytes, config.chunk_size_tokens, settings.reuse_generated, snapshots)

    def keyed(self, key: Hashable) -> PrefixCache:
        """The cache for K/V computed under ``key`` (a LoRA adapter's name and digest: its K/V
        for the same tokens differ from the base's): entries apart, LRU and budget shared."""
        view = self._views.get(key)
        if view is None:
            view = copy.copy(self)
            view._key, view._views, view._pending, view._pins = (_MODEL_KEY, key), {}, [], {}
            view._hit_tokens = view._lookup_tokens = view._evictions = 0
            self._views[key] = view
        return view

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes + self._unlisted_pin_bytes

    def lookup(self, tokens: tuple[int, ...]) -> Lookup:
        """Caches holding the longest reusable prefix of ``tokens`` (at least one token is left)."""
        self._lookup_tokens += len(tokens)
        with self._lock:
            found = self._nearest(tokens)
        if found is None:
            return Lookup(None, 0)
        held, caches = found
        usable = self._usable(len(tokens), held)
        if usable <= 0 or (self.snapshots and usable != held):
            return Lookup(None, 0)  # a snapshot is used whole or not at all
        self._hit_tokens += usable
        return Lookup(snapshot(caches) if self.snapshots else reading(caches, usable), usable)

    def _nearest(self, tokens: tuple[int, ...]) -> tuple[int, list[Any]] | None:
        """Under the lock: (tokens shared, caches) of the entry sharing most of ``tokens``."""
        found = self._lru._trie.search(self._key, list(tokens))
        if self.snapshots:  # only an entry that is a prefix of ``tokens`` holds their state
            held = found.exact or found.shorter
            return None if held is None else (len(held), self._lru._trie.get(self._key, held)
                                              .prompt_cache)
        if found.exact is not None:
            return len(found.exact), self._lru._trie.get(self._key, found.exact).prompt_cache
        shorter = len(found.shorter) if found.shorter is not None else 0
        if found.longer is not None and found.common_prefix > shorter:
            entry = self._lru._trie.get(self._key, found.longer)
            return found.common_prefix, entry.prompt_cache
        if shorter:
            return shorter, self._lru._trie.get(self._key, found.shorter).prompt_cache
        return None

    def _usable(self, prompt_len: int, held: int) -> int:
        if self.reuse_generated:
            return min(held, prompt_len - 1)
        return self.grid.usable(held, prompt_len)

    def store_prompt(self, tokens: tuple[int, ...], caches: list[Any]) -> None:
        """Keep what a prefill just computed exactly (call before decoding extends it)."""
        if not self.snapshots or self.reuse_generated:  # a snapshot holds all it was fed
            self._store(tokens[: self._storable(tokens)], caches)

    def store_received(self, tokens: tuple[int, ...], caches: list[Any],
                       share_min_bytes: int = SHARE_MIN_BYTES) -> None:
        """``store_prompt`` for a handed-off cache: read in place where it is large.

        Why: the copy ran on the decode node's engine thread between two steps,
        a pass over every received byte that delayed every running stream. The
        entry holds the received arrays themselves (``sharing``); decoding writes
        only past the prompt. A cache under ``share_min_bytes`` is still copied:
        its arrays share the receiver's 64 MiB slabs with other handoffs, which
        the entry would keep alive.
        """
        if not self.snapshots or self.reuse_generated:
            share = sum(c.nbytes for c in caches) >= share_min_bytes
            self._store(tokens[: self._storable(tokens)], caches, share=share)

    def snapshot_hook(self, tokens: tuple[int, ...], caches: list[Any]) -> Any:
        """For ``run_prefill``'s ``on_full_chunks``: snapshot the state at the last full chunk.

        None unless this cache keeps snapshots (trimmable caches keep the
        full chunks from the prompt's end state instead).
        """
        if not (self.enabled and self.snapshots):
            return None

        def at_boundary(done_tokens: int) -> None:
            if done_tokens > 0:
                self._insert(tokens[:done_tokens], snapshot(caches))
        return at_boundary

    def store_prompt_later(self, tokens: tuple[int, ...], caches: list[Any]) -> None:
        """``store_prompt`` at the next ``store_pending``: once the first token is out.

        Decoding only writes positions past the prompt, so the stored part
        reads the same then.
        """
        if self.enabled and (not self.snapshots or self.reuse_generated):
            self._pending.append((tokens[: self._storable(tokens)], caches))

    def store_pending(self, adopt: bool = False) -> None:
        """Copy in what ``store_prompt_later`` queued (the engine loop, after emitting).

        ``adopt``: the caches are nobody else's (a prefill-only job's: nothing decodes
        them), so they are kept, not copied: on a prefill node the copy ran while its
        K/V went out, a second pass over every byte inside the handoff window.
        """
        pending, self._pending = self._pending, []
        for tokens, caches in pending:
            self._store(tokens, caches, adopt=adopt)

    def _storable(self, tokens: tuple[int, ...]) -> int:
        if self.reuse_generated:
            return len(tokens)  # any prefix is reusable in this mode
        return self.grid.exact_end(len(tokens))

    def store_finished(self, tokens: tuple[int, ...], caches: list[Any]) -> None:
        """``reuse_generated``: keep a finished sequence's prompt and reply.

        The caches are adopted, not copied: the caller hands over caches no
        one else uses or extends (a finished sequence's own, or a batch
        extract); their spare capacity counts in ``nbytes``.
        """
        if self.reuse_generated:
            self._store(tokens, caches, adopt=True)

    def _store(self, tokens: tuple[int, ...], caches: list[Any], adopt: bool = False,
               share: bool = False) -> None:
        """Keep ``caches`` (holding exactly ``tokens``, or more if they can be cut back);
        ``adopt``: as they are; ``share``: views of them, where nothing writes them."""
        if not self.enabled or not tokens:
            return
        if self.snapshots:  # the caller's caches hold exactly ``tokens``
            mx.eval([c.state for c in caches])
            self._insert(tokens, caches if adopt else snapshot(caches))
            return
        if not cacheable(caches) or caches[0].offset < len(tokens):
            return  # the caches do not hold these tokens (nothing to key them by)
        if adopt:
            trim_prompt_cache(caches, caches[0].offset - len(tokens))
            mx.eval([(c.keys, c.values) for c in caches])  # no lazy graph left on a batch's buffer
            entry = caches
        elif share:
            entry = sharing(caches, len(tokens))
            mx.eval([(c.keys, c.values) for c in entry])  # already evaluated: no work
        else:
            entry = compact_copy(caches, len(tokens))
        self._insert(tokens, entry)

    def _insert(self, tokens: tuple[int, ...], entry: list[Any]) -> None:
        with self._lock:
            self._lru.insert_cache(self._key, list(tokens), entry)
            self._recount_pins()
        self.evict_to(self.max_bytes)

    def evict_to(self, max_bytes: int) -> int:
        """Drop least-recently-stored entries until at most ``max_bytes`` remain; bytes freed."""
        with self._lock:
            before, entries = self.nbytes, len(self._lru)
            self._lru.trim_to(n_bytes=max(0, max_bytes - self._unlisted_pin_bytes))
            self._evictions += entries - len(self._lru)
            self._recount_pins()
            return before - self.nbytes

    # -- pins (delta handoffs) -----------------------------------------------------------

    def pin(self, request_id: str, tokens: Sequence[int], prefix_tokens: int) -> bool:
        """Hold the stored K/V of exactly ``tokens[:prefix_tokens]`` for ``request_id``.

        Only a prefix whose reuse is exact qualifies (as ``lookup`` reuses),
        unless ``reuse_generated``. False when nothing stored holds it.
        """
        if not self.enabled or self.snapshots or not self._pinnable(len(tokens), prefix_tokens):
            return False  # a delta splices plain KVCache layers only
        prefix = tuple(tokens[:prefix_tokens])
        with self._lock:
            held = self._entry_holding(prefix)
            if held is None:
                return False
            self._pins[request_id] = Pin(prefix_tokens, held[1], held[0])
            self._recount_pins()
        return True

    def take_pin(self, request_id: str) -> Pin | None:
        """End ``request_id``'s pin and return it (None when it has none)."""
        with self._lock:
            pin = self._pins.pop(request_id, None)
            self._recount_pins()
        return pin

    def unpin(self, request_id: str) -> None:
        self.take_pin(request_id)

    def _pinnable(self, prompt_len: int, prefix_tokens: int) -> bool:
        if not 0 < prefix_tokens < prompt_len:
            return False
        return self.reuse_generated or self._usable(prompt_len, prefix_tokens) == prefix_tokens

    def _entry_holding(self, prefix: tuple[int, ...]) -> tuple[tuple[int, ...], list[Any]] | None:
        """(tokens, caches) of a stored entry that starts with ``prefix``, read in place.

        mlx-lm's trie, not ``fetch_nearest_cache``: that deep-copies the entry,
        and a pin only needs to keep the arrays alive.
        """
        trie = self._lru._trie
        found = trie.search(self._key, list(prefix))
        tokens = found.exact or (found.longer if found.common_prefix >= len(prefix) else None)
        if tokens is None:
            return None
        return tuple(tokens), trie.get(self._key, tokens).prompt_cache

    def _recount_pins(self) -> None:
        """Under the lock: bytes of pinned entries the LRU no longer lists (still held)."""
        unlisted = {id(p.caches): p.nbytes for p in self._pins.values() if not self._listed(p)}
        self._unlisted_pin_bytes = sum(unlisted.values())

    def _listed(self, pin: Pin) -> bool:
        try:
            entry = self._lru._trie.get(self._key, list(pin.entry_tokens))
        except KeyError:
            return False
        return entry.prompt_cache is pin.caches

    def stats(self) -> PrefixCacheStats:
        caches = [self, *self._views.values()]  # the keyed views count their own
        return PrefixCacheStats(
            hit_tokens=sum(c._hit_tokens for c in caches),
            lookup_tokens=sum(c._lookup_tokens for c in caches),
            cached_bytes=self._lru.nbytes,
            entries=len(self._lru),
            evictions=sum(c._evictions for c in caches),
            # A router trusts its guess of what a node holds (deltas, local prefills)
            # only where this is > 0; snapshots are kept from the node's own prefills
            # alone, not from handoffs, so that guess would be wrong.
            capacity_bytes=0 if self.snapshots else self.max_bytes,
            exact_min_rows=self.grid.min_rows or 0,
        )
