"""The contract between the router and a discovery source (built-in or third-party).

A source tells the router which prefill and decode nodes exist *now*. It is one
small object: a ``name`` (its registered ``--discovery`` value) and ``watch()``,
an async iterator of full snapshots (``frozenset[Member]``): the first as soon
as the source knows anything (an empty one is fine), then one each time the set
changes. The router unions the snapshots of every source it runs, dials and
handshakes new members (with the cluster secret, as any peer) and drains the
ones that left. A source never dials; the router checks what it learns.

Plugins register ``factory(config: ServerConfig, discovery: DiscoveryConfig) ->
DiscoverySource`` through ``mlxcel_register_discovery``; building a source must
not start any I/O (``watch`` does, and ``aclose`` on its iterator stops it).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from mlxcel_plugin.compatibility import NodeProfile
from mlxcel_plugin.config import dataclass_from_mapping, parse_host_port

NODE_ROLES = ("prefill", "decode")
DNS_PREFIX = "dns:"  # ``dns:NAME:PORT`` in --prefill-peers / --decode-peers
MDNS_SERVICE_TYPE = "_mlxcel._tcp.local."
FINGERPRINT_CHARS = 16


@dataclass(frozen=True)
class Member:
    """One node a source found: its role, link address and, when known, model fingerprint."""

    role: str
    address: str  # host:port of the node's link listener (``--serving-bind``)
    fingerprint: str | None = None  # ``model_fingerprint`` of its checkpoint; None: unknown
    source: str = ""  # the source's name, for logs and /router/stats
    # Its pinned profile (tokenizer/template digests, KV summary), when the source carries one.
    profile: NodeProfile | None = None

    def __post_init__(self) -> None:
        if self.role not in NODE_ROLES:
            raise ValueError(f"a member's role is one of {NODE_ROLES}, got {self.role!r}")
        parse_host_port(self.address)

    @property
    def key(self) -> tuple[str, str]:
        """What makes two members the same node (the fingerprint and source do not)."""
        return self.role, self.address


Snapshot = frozenset[Member]


@runtime_checkable
class DiscoverySource(Protocol):
    name: str

    def watch(self) -> AsyncIterator[Snapshot]: ...


@dataclass(frozen=True)
class DiscoveryConfig:
    """TOML section ``[discovery]``."""

    interval_s: float = 5.0  # polling sources (file, dns) look again this often
    drain_timeout_s: float = 300.0  # a node that left is dropped by then, even if still busy
    nameservers: tuple[str, ...] = ()  # host:port each; empty: the system resolver
    kubernetes_namespace: str = ""  # empty: the pod's own namespace, else "default"
    kubernetes_selector: str = "app.kubernetes.io/part-of=mlxcel"
    kubernetes_role_label: str = "disaggregatedset.x-k8s.io/role"
    kubernetes_port_name: str = "link"  # the container port of the node's link listener

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> DiscoveryConfig:
        return dataclass_from_mapping(cls, section, "[discovery]")


def is_dns_entry(entry: str) -> bool:
    return entry.startswith(DNS_PREFIX)


def parse_dns_entry(entry: str) -> tuple[str, int]:
    """``dns:NAME:PORT`` -> ``(NAME, PORT)``."""
    return parse_host_port(entry[len(DNS_PREFIX):])


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 literal in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def model_fingerprint(model_dir: str | Path | None) -> str | None:
    """A short digest of a checkpoint's ``config.json`` (None without one).

    Two nodes serve the same model when their digests agree; the router compares
    what a node advertises with its own checkpoint's before giving it traffic.
    """
    if model_dir is None:
        return None
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()[:FINGERPRINT_CHARS]


PROFILE_KEYS = ("kv", "tokenizer", "chat_template")  # what a source may pin of a node's profile


def pinned_profile(pins: Mapping[str, Any]) -> NodeProfile | None:
    """The profile a discovery entry pins (peers-file keys, mdns TXT); None when none."""
    announce = {key: pins[key] for key in PROFILE_KEYS if isinstance(pins.get(key), str)}
    return NodeProfile.from_announce(announce) if any(announce.values()) else None
