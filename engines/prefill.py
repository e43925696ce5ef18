"""The one prefill forward shared by the hybrid and prefill roles.

Hybrid ``generate`` and ``prefill`` must produce bit-identical caches and
logits, and the numbers depend on the shape of the work (chunk sizes), so both
roles call :func:`run_prefill` with the same ``chunk_size_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

LayerEvaluated = Callable[[int, Any], None]


def run_prefill(
    model: nn.Module,
    tokens: list[int] | tuple[int, ...],
    caches: list[Any],
    chunk_size_tokens: int,
    on_layer: LayerEvaluated | None = None,
) -> mx.array:
    """Run the prompt through ``model`` into ``caches``; return the last position's logits.

    Full chunks are evaluated as they go (bounded memory). The last token goes
    through on its own, so the vocabulary projection (which MLX computes only
    for outputs someone evaluates) runs for one position instead of a chunk.
    Then the caches are evaluated layer by layer in order — MLX is lazy, so
    layer i's K/V are ready (and ``on_layer(i, cache)`` can ship them) while
    later layers are still to be computed. Unlike mlx-lm's ``generate_step``
    nothing runs ahead: the caches hold exactly the prompt.
    """
    if chunk_size_tokens < 1:
        raise ValueError(f"chunk_size_tokens must be >= 1, got {chunk_size_tokens}")
    prompt = mx.array(tokens, dtype=mx.uint32)[None]
    start, total = 0, prompt.shape[1]
    while total - start > chunk_size_tokens:
        model(prompt[:, start : start + chunk_size_tokens], cache=caches)
        mx.eval([c.state for c in caches])
        start += chunk_size_tokens
    if total - start > 1:
        model(prompt[:, start : total - 1], cache=caches)
    logits = model(prompt[:, total - 1 :], cache=caches)[0, -1, :]
    for i, cache in enumerate(caches):
        mx.eval(cache.state)
        if on_layer is not None:
            on_layer(i, cache)
    mx.eval(logits)
    return logits
