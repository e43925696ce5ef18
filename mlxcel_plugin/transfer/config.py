"""TransferConfig: the ``[transfer]`` table of ``--distributed-config``.

An explicit ``strategy`` or ``codec`` always wins over the AdaptiveSelector;
``"auto"`` leaves the choice to it. Names are checked against the plugin
registry at startup by the caller (``registry.get``), not here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from mlxcel_plugin.errors import ConfigError
from mlxcel_plugin.kv_serde import DEFAULT_MAX_BODY_BYTES
from mlxcel_plugin.kv_serde.versions import LARGE_CHUNK_BYTES

AUTO = "auto"
MIN_CHUNK_BYTES = 4096
MAX_PARALLELISM = 64


@dataclass(frozen=True)
class TransferConfig:
    strategy: str = AUTO  # "auto" or a registered strategy name ("full", "streamed", ...)
    codec: str = AUTO  # "auto", "none", or a registered codec / chain ("shuffle+lz4")
    parallelism: int = 1  # links per handoff that LayerParallel may use
    # Raw tensor bytes per chunk, at most: 8 MiB - 64 KiB for coded chunks and for a receiver
    # of serde version 4 or older (nodes/handoff_start.py).
    chunk_bytes: int = LARGE_CHUNK_BYTES
    # A handoff fails once none of its KV moved for this long (sender and receiver alike);
    # a slow one keeps going while its bytes flow. The sender frees its copy on the ack.
    transfer_timeout_s: float = 30.0
    # Lossy codecs change the tokens; "auto" only picks them when this is set.
    allow_lossy: bool = False

    def __post_init__(self) -> None:
        for name in ("strategy", "codec"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"transfer.{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.parallelism, int) or not 1 <= self.parallelism <= MAX_PARALLELISM:
            raise ConfigError(f"transfer.parallelism must be 1..{MAX_PARALLELISM}")
        if not isinstance(self.chunk_bytes, int) or not (
            MIN_CHUNK_BYTES <= self.chunk_bytes <= LARGE_CHUNK_BYTES
        ):
            raise ConfigError(
                f"transfer.chunk_bytes must be {MIN_CHUNK_BYTES}..{LARGE_CHUNK_BYTES} "
                "(the most a receiver takes in one chunk)"
            )
        if not isinstance(self.transfer_timeout_s, int | float) or self.transfer_timeout_s <= 0:
            raise ConfigError("transfer.transfer_timeout_s must be > 0")

    @property
    def record_chunk_bytes(self) -> int:
        """``chunk_bytes`` within one record's 8 MiB − 64 KiB: what a receiver of serde version
        4 or older takes, and what a codec that transforms the bytes sends. Why not larger
        for a codec: the sender encodes a whole chunk before its first byte goes and the
        receiver decodes the last one after it is in (transfer/selector.py's pipeline), so a
        coded chunk's size is the handoff's fill and drain; its bookkeeping is small beside."""
        return min(self.chunk_bytes, DEFAULT_MAX_BODY_BYTES)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TransferConfig:
        known = {spec.name for spec in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown transfer keys {unknown}; known: {sorted(known)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return {spec.name: getattr(self, spec.name) for spec in fields(self)}
