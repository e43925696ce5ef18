"""The layers whose buffers a receiver readies at the begin, before their first chunk.

Why: every strategy's begin leaves the prefill node when its prefill starts (Full holds
only its chunks until prefill ends: ``transfer/full.py``). A receiver that allocates a
layer's buffers on its first chunk does it on the transfer's path while its bulk readers
wait for a destination: for an 8B-shaped handoff, 4-5 ms between the decode node hearing
of the first body and starting to read it (MLX's allocation of 64 arrays, its I/O
thread taking the GIL for each), on the critical path of every handoff. A plain
``KVCache`` layer's shape follows from the begin alone (the shipped positions, at the
prompt's offset, no meta), so such layers are allocated at the begin instead, while
prefill computes. The begin's budget check already bounds them, and the decode
scheduler reserved their bytes then.

Only where the receive buffers are the engine's own memory (``ReceiveMemory.make_buffers``):
buffers from a receiver's pool go back to it as each layer is adopted by copying, so the
next layer reuses them, which allocating every layer at the begin would forgo.

A chunk that describes its layer otherwise (a sender that ships it another way) gets the
layer allocated on that chunk, as before; what was readied for it is let go.
"""

from __future__ import annotations

from collections.abc import Iterator

from mlxcel_plugin.kv_serde.header import HandoffHeader, ModelFingerprint
from mlxcel_plugin.kv_serde.messages import LayerDescriptor

PLAIN_KV_CLASS = "KVCache"  # mlx-lm's growing K/V cache: writers send its meta empty


def expected_layers(fp: ModelFingerprint, header: HandoffHeader
                    ) -> Iterator[tuple[int, LayerDescriptor]]:
    """(index, descriptor) of each layer whose chunks will describe it so, as writers
    describe a plain K/V layer (``kv_serde/writer.py``: tokens held, offset, meta)."""
    for index, kind in enumerate(fp.cache_classes):
        if kind == PLAIN_KV_CLASS:
            yield index, LayerDescriptor(header.shipped_tokens, header.prompt_length, {})
