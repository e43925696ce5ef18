"""The one prefill forward shared by the hybrid and prefill roles.

Hybrid ``generate`` and ``prefill`` must produce bit-identical caches and
logits, and the numbers depend on the shape of the work (chunk sizes), so both
roles call :func:`run_prefill` with the same ``chunk_size_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from engines import kv_convert
from engines.decode_batch import DecodeBatch, Sequence
from engines.grammar import request_sampler, warm_grammar_tokenizer
from engines.prefix import padded_keys, reuse_probe
from engines.prefix.cache import PrefixCache
from engines.prefix.grid import PrefillGrid
from engines.prompt_logprobs import prompt_logprobs_collector
from engines.sampling import TokenSampler
from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest, ModelInfo
from mlxcel_plugin.logprobs import PromptLogprobs, TokenLogprobs

LayerEvaluated = Callable[[int, Any], None]
# (first position, lazy logits [1, n, vocab] of a forward before it is evaluated), for
# every forward but the last token's (which predicts the first generated token).
ChunkLogits = Callable[[int, mx.array], None]


def _ignore_logits(_start: int, _logits: mx.array) -> None:
    pass  # MLX computes only what is evaluated: unread logits cost nothing
FullChunksDone = Callable[[int], None]  # tokens done when the last full chunk is evaluated
# (first token, end, caches): tokens [first, end) of every cache are final (a forward is done).
CellDone = Callable[[int, int, list[Any]], None]
WARMUP_TOKENS = (0, 1, 2, 3, 4, 5, 6, 7)


def run_prefill(
    model: nn.Module,
    tokens: list[int] | tuple[int, ...],
    caches: list[Any],
    grid: PrefillGrid | int,
    on_layer: LayerEvaluated | None = None,
    on_logits: ChunkLogits = _ignore_logits,  # prompt logprobs (engines/prompt_logprobs.py)
    held_tokens: int | None = None,
    on_full_chunks: FullChunksDone | None = None,
    on_cell: CellDone | None = None,
) -> mx.array:
    """Run the prompt through ``model`` into ``caches``; return the last position's logits.

    ``grid`` (or a chunk size) splits forwards: never across a cell's end, the last token
    alone (engines/prefix/grid.py); ``caches`` may hold a prefix of ``tokens``, resumed
    after. On an any-token grid a forward's keys are padded to its cell's end (padded_keys).

    Each forward is evaluated as it goes (bounded memory); ``on_cell(first, end, caches)``
    follows each but the last (positions ``[first, end)`` final, contiguous from 0). The
    last token goes alone, so the vocabulary projection runs for one position; then the
    caches are evaluated layer by layer — MLX is lazy, so layer i's K/V are ready
    (``on_layer(i, cache)`` ships them) while later layers still compute.

    ``held_tokens``: tokens ``caches`` hold (None: a KV layer's offset). ``on_full_chunks(n)``
    runs once the whole cells are evaluated, holding ``n`` tokens (prefix cache snapshots).
    """
    grid = grid if isinstance(grid, PrefillGrid) else PrefillGrid(grid)
    prompt = mx.array(tokens, dtype=mx.uint32)[None]
    start = _held_tokens(caches) if held_tokens is None else held_tokens
    total = prompt.shape[1]
    if start >= total:
        raise ValueError(f"the caches hold {start} tokens; the prompt has only {total}")
    *spans, last = grid.forwards(start, total)
    full_cells = max(start, grid.full_cells_end(total))
    for begin, end in spans:
        if begin == full_cells and on_full_chunks is not None:
            on_full_chunks(begin)
        on_logits(begin, _forward(model, prompt[:, begin:end], caches, grid, begin))
        mx.eval([c.state for c in caches])
        if on_cell is not None:  # the first forward's rows come with the reused prefix's
            on_cell(begin if begin > start else 0, end, caches)
    if full_cells == total - 1 and on_full_chunks is not None:
        on_full_chunks(full_cells)
    logits = _forward(model, prompt[:, last[0]:], caches, grid, last[0])[0, -1, :]
    for i, cache in enumerate(caches):
        mx.eval(cache.state)
        if on_layer is not None:
            on_layer(i, cache)
    mx.eval(logits)
    return logits


def _forward(model: nn.Module, tokens: mx.array, caches: list[Any], grid: PrefillGrid,
             begin: int) -> mx.array:
    if grid.any_token:
        return model(tokens, cache=padded_keys.padded(caches, grid.cell_end(begin)))
    return model(tokens, cache=caches)


def _held_tokens(caches: list[Any]) -> int:
    offset = getattr(caches[0], "offset", 0) if caches else 0
    return offset if isinstance(offset, int) else 0


@dataclass
class Prefilled:
    sampler: TokenSampler
    token: int  # the first token, sampled at the prompt's end
    caches: list[Any]
    cached_tokens: int  # prompt tokens reused from the prefix cache
    logprobs: TokenLogprobs | None = None  # the first token's, when asked
    prompt_logprobs: PromptLogprobs | None = None  # when asked


def prefill_request(
    model: nn.Module,
    request: GenerationRequest,
    prefix: PrefixCache,
    config: EngineConfig,
    info: ModelInfo,
    on_layer: LayerEvaluated | None = None,
    on_cell: CellDone | None = None,
) -> Prefilled:
    """Both roles' prefill: reuse a cached prefix, forward the rest, sample the first token."""
    prompt = request.prompt_tokens
    sampler = request_sampler(request, info)  # a grammar that cannot be built fails first
    # Prompt logprobs need every position's logits: no reuse (engines/prompt_logprobs.py).
    collector = prompt_logprobs_collector(request)
    reused = prefix.lookup(prompt) if prefix.enabled and collector is None else None
    caches = reused.caches if reused and reused.caches else make_prompt_cache(model)
    if on_layer is not None:  # the prefill role: refuse what no decode node could take
        kv_convert.check_cache_kinds(caches)  # before computing anything
    held = reused.reused_tokens if reused else 0
    logits = run_prefill(model, prompt, caches, prefix.grid, on_layer,
                         collector or _ignore_logits, held, prefix.snapshot_hook(prompt, caches),
                         on_cell)
    prefix.store_prompt_later(prompt, caches)  # copied once the first token is out
    row = np.array(logits.astype(mx.float32))
    token = sampler.sample(row, len(prompt))
    sampler.observe(token)
    prompt_logprobs = None if collector is None else collector.result()
    return Prefilled(sampler, token, caches, reused.reused_tokens if reused else 0,
                     sampler.logprobs(row, token), prompt_logprobs)


def prepare_prefills(model: nn.Module, prefix: PrefixCache, config: EngineConfig,
                     info: ModelInfo) -> None:
    """At engine start: probe the grid every prefill follows (its numbers), then warm up."""
    prefix.grid = reuse_probe.prefill_grid(model, config, info)
    if config.warmup:
        warm_up(model, prefix.grid)
        warm_grammar_tokenizer(info)  # else the first constrained request waits for it


def warm_up(model: nn.Module, grid: PrefillGrid) -> None:
    """Run the prefill and batch-decode paths once so the first request pays no set-up."""
    caches = make_prompt_cache(model)
    run_prefill(model, WARMUP_TOKENS, caches, grid)
    batch = DecodeBatch(model)
    # A placeholder sequence: step() only reads its last token, nothing is emitted.
    batch.add([Sequence(None, None, None, last_token=0, num_generated=1)], [caches])
    batch.step()
