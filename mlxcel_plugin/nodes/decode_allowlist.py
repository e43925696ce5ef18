"""Which decode nodes a prefill node may hand a KV cache to (policy, not wire format).

Entries and targets are compared as canonical ``host:port`` strings
(``request_checks.canonical_host_port``), parsed once: the list when it is
loaded, a target when its REQUEST arrives. A malformed entry stops the node
at startup; a malformed target is never allowed (a REQUEST carrying one is
already refused as ``decode_target_malformed`` when it is parsed), instead of
passing the check and failing only when dialed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from mlxcel_plugin.errors import ConfigError
from mlxcel_plugin.link.protocol.request_checks import DecodeTargetMalformed, canonical_host_port

DECODE_ALLOWLIST_ENV = "MLXCEL_DECODE_ALLOWLIST"


@dataclass(frozen=True)
class DecodeAllowlist:
    """Canonical host:port targets a router may name as ``decode_target``; empty allows any.

    Empty is safe by default because the router is authenticated by the handshake;
    the list narrows where a compromised router could send a prompt's KV.
    """

    targets: frozenset[str] = frozenset()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> DecodeAllowlist:
        raw = env.get(DECODE_ALLOWLIST_ENV, "")
        return cls.parse(item.strip() for item in raw.split(",") if item.strip())

    @classmethod
    def parse(cls, entries: Iterable[str]) -> DecodeAllowlist:
        targets = set()
        for entry in entries:  # bounded by the configured list
            try:
                targets.add(canonical_host_port(entry))
            except DecodeTargetMalformed as exc:
                raise ConfigError(f"{DECODE_ALLOWLIST_ENV}: {exc.message}") from None
        return cls(frozenset(targets))

    def allows(self, target: str) -> bool:
        """A malformed target is never allowed (``canonical_host_port`` says why)."""
        try:
            canonical = canonical_host_port(target)
        except DecodeTargetMalformed:
            return False
        return not self.targets or canonical in self.targets
