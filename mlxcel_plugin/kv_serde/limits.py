"""What one handoff may make a receiver hold: its bytes, its prompt, each chunk's size."""

from __future__ import annotations

from dataclasses import dataclass

from mlxcel_plugin.kv_serde.versions import LARGE_CHUNK_BYTES

GIB = 1 << 30


@dataclass(frozen=True)
class AssemblerLimits:
    max_bytes: int = 8 * GIB  # decoded K/V bytes one handoff may allocate
    max_prompt_tokens: int = 1 << 20
    # Encoded body of one chunk (senders keep to one record's 8 MiB − 64 KiB unless this node
    # announced LARGE_CHUNK_SERDE_VERSION).
    max_body_bytes: int = LARGE_CHUNK_BYTES
    # Decoded bytes of one chunk: bounds a codec's output (int4 expands ≈3.5×).
    max_chunk_raw_bytes: int = LARGE_CHUNK_BYTES
