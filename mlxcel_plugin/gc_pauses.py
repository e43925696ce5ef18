"""Keep the cyclic garbage collector's full passes off the serving path.

Why: once a node has started, its heap holds ~90k long-lived objects (mlx-lm,
transformers, the tokenizer, the link stack), and every generation-2
collection walks all of them: 47-58 ms pauses here, landing in the middle of
KV handoffs (a 256 MiB handoff takes ~100 ms) and decode steps. Frozen
objects are never scanned again, so later full passes walk only what was
allocated since. Call once, after start-up and before serving.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect what start-up left behind, then exempt the survivors from later passes.

    Returns how many objects are now frozen.
    """
    gc.collect()  # garbage is freed first: a frozen cycle would never be
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.debug("froze %d start-up objects out of garbage collection", frozen)
    return frozen
