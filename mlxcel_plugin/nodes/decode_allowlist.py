"""Which decode nodes a prefill node may hand a KV cache to (policy, not wire format)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

DECODE_ALLOWLIST_ENV = "MLXCEL_DECODE_ALLOWLIST"


@dataclass(frozen=True)
class DecodeAllowlist:
    """host:port targets a router may name as ``decode_target``; empty allows any.

    Empty is safe by default because the router is authenticated by the handshake;
    the list narrows where a compromised router could send a prompt's KV.
    """

    targets: frozenset[str] = frozenset()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> DecodeAllowlist:
        raw = env.get(DECODE_ALLOWLIST_ENV, "")
        return cls(frozenset(item.strip() for item in raw.split(",") if item.strip()))

    def allows(self, target: str) -> bool:
        return not self.targets or target.strip() in self.targets
