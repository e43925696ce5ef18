"""The router's peer registry: stable ids, health, live telemetry, counters, prefixes.

Pure bookkeeping: the health monitor and the links call in with ``now`` and
what happened; selection reads ``views``. Nothing here opens a connection.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

from mlxcel_plugin.balancer_api import NodeView
from mlxcel_plugin.discovery_api import is_dns_entry
from router_plugin.cluster.pairing import PairingTable
from router_plugin.cluster.prefix_index import PrefixIndex

ROLES = ("prefill", "decode")
REDACTED = "<redacted>"
STATS_VERBOSE_ENV = "MLXCEL_ROUTER_STATS_VERBOSE"
DEFAULT_STALE_TELEMETRY_S = 5.0


class NodeHealth(StrEnum):
    UNKNOWN = "unknown"  # configured, never connected or probed yet
    HEALTHY = "healthy"
    UNREACHABLE = "unreachable"  # last transport attempt failed; re-probed later
    DRAINING = "draining"  # finishes its work but takes nothing new


@dataclass(frozen=True)
class NodeTelemetry:
    """One report a node sends over its link."""

    queue_depth: int = 0
    active_sequences: int = 0
    free_kv_fraction: float = 1.0
    tokens_per_s: float = 0.0
    prefix_hit_tokens: int = 0
    prefix_lookup_tokens: int = 0
    prefix_cached_bytes: int = 0
    prefix_evictions: int = 0
    prefix_capacity_bytes: int = 0
    adapters: Mapping[str, str] = field(default_factory=dict)  # LoRA name -> digest held
    speculative: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # (proposed, accepted)


@dataclass
class _Node:
    node_id: str
    role: str
    address: str
    health: NodeHealth = NodeHealth.UNKNOWN
    health_since_s: float | None = None  # None: still in its initial state
    telemetry: NodeTelemetry = field(default_factory=NodeTelemetry)
    telemetry_at_s: float | None = None
    in_flight: int = 0
    dispatched: int = 0
    consecutive_failures: int = 0
    total_failures: int = 0
    last_error: str = ""


def _age_s(since_s: float | None, now: float) -> float | None:
    return None if since_s is None else max(0.0, now - since_s)


def _telemetry_stats(telemetry: NodeTelemetry, age_s: float) -> dict[str, Any]:
    stats = {**asdict(telemetry), "age_s": age_s}
    if not telemetry.adapters:  # a node without adapters shows what it always did
        del stats["adapters"]
    if not telemetry.speculative:  # the same for one that never speculated
        del stats["speculative"]
    return stats


def stats_verbose_from_env(env: Mapping[str, str]) -> bool:
    return env.get(STATS_VERBOSE_ENV, "").strip() == "1"


class NodePool:
    """Prefill and decode peers, each with an id like ``prefill-0`` that never changes."""

    def __init__(self, *, stale_telemetry_s: float = DEFAULT_STALE_TELEMETRY_S,
                 prefixes: PrefixIndex | None = None, pairing: PairingTable | None = None):
        self.stale_telemetry_s = stale_telemetry_s
        # Which prefill node may hand off to which decode node (from their announcements).
        self.pairing = pairing if pairing is not None else PairingTable()
        # Which prompt prefixes each node probably holds (fed by the routed requests).
        self.prefixes = prefixes if prefixes is not None else PrefixIndex()
        self._nodes: dict[str, _Node] = {}
        self._next_index = {role: 0 for role in ROLES}

    @classmethod
    def from_peers(
        cls, prefill_peers: Iterable[str], decode_peers: Iterable[str], **kwargs: Any
    ) -> NodePool:
        """The static peers; ``dns:NAME:PORT`` entries are the ``dns`` discovery source's."""
        pool = cls(**kwargs)
        for role, addresses in (("prefill", prefill_peers), ("decode", decode_peers)):
            for address in addresses:
                if not is_dns_entry(address):
                    pool.add(role, address)
        return pool

    # --- membership ----------------------------------------------------------

    def add(self, role: str, address: str) -> str:
        """Register a peer and return its id; ids are never reused after ``remove``."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        node_id = f"{role}-{self._next_index[role]}"
        self._next_index[role] += 1
        self._nodes[node_id] = _Node(node_id=node_id, role=role, address=address)
        return node_id

    def remove(self, node_id: str) -> None:
        del self._nodes[node_id]
        self.prefixes.forget(node_id)
        self.pairing.forget(node_id)

    def ids(self, role: str | None = None) -> list[str]:
        return [n.node_id for n in self._nodes.values() if role is None or n.role == role]

    def find(self, address: str, role: str | None = None) -> str | None:
        """The id of the peer at ``address`` (links know addresses, stats know ids)."""
        for node in self._nodes.values():
            if node.address == address and (role is None or node.role == role):
                return node.node_id
        return None

    def address(self, node_id: str) -> str:
        return self._nodes[node_id].address

    def role(self, node_id: str) -> str:
        return self._nodes[node_id].role

    def health(self, node_id: str) -> NodeHealth:
        return self._nodes[node_id].health

    def in_flight(self, node_id: str) -> int:
        return self._nodes[node_id].in_flight

    # --- health --------------------------------------------------------------

    def mark_unreachable(self, node_id: str, now: float, error: str = "") -> bool:
        """A transport error or failed probe; returns True when the state changed."""
        node = self._nodes[node_id]
        node.consecutive_failures += 1
        node.total_failures += 1
        node.last_error = error
        # What it reported before it vanished says nothing about it now, nor what it held.
        node.telemetry, node.telemetry_at_s = NodeTelemetry(), None
        self.prefixes.forget(node_id)
        return self._set_health(node, NodeHealth.UNREACHABLE, now)

    def mark_healthy(self, node_id: str, now: float) -> bool:
        """A successful probe or handshake; returns True when the state changed."""
        node = self._nodes[node_id]
        node.consecutive_failures = 0
        return self._set_health(node, NodeHealth.HEALTHY, now)

    def mark_draining(self, node_id: str, now: float) -> bool:
        return self._set_health(self._nodes[node_id], NodeHealth.DRAINING, now)

    def undrain(self, node_id: str, connected: bool, now: float) -> bool:
        """A draining node came back (discovery lists it again): serve it if its link is up."""
        node = self._nodes[node_id]
        if node.health is not NodeHealth.DRAINING:
            return False
        return self._set_health(node, NodeHealth.HEALTHY if connected else NodeHealth.UNKNOWN,
                                now)

    def probe_candidates(self, role: str) -> list[str]:
        """Peers worth a re-probe: neither healthy nor draining on purpose."""
        wanted = (NodeHealth.UNKNOWN, NodeHealth.UNREACHABLE)
        return [n.node_id for n in self._nodes.values() if n.role == role and n.health in wanted]

    @staticmethod
    def _set_health(node: _Node, health: NodeHealth, now: float) -> bool:
        if node.health == health:
            return False
        node.health, node.health_since_s = health, now
        return True

    # --- telemetry and counters ----------------------------------------------

    def update_telemetry(self, node_id: str, telemetry: NodeTelemetry, now: float) -> None:
        node = self._nodes[node_id]
        node.telemetry, node.telemetry_at_s = telemetry, now

    def on_dispatch(self, node_id: str) -> None:
        node = self._nodes[node_id]
        node.in_flight += 1
        node.dispatched += 1

    def on_finish(self, node_id: str) -> None:
        """The router saw the request leave this node (finished, failed or re-routed)."""
        node = self._nodes.get(node_id)
        if node is not None and node.in_flight > 0:
            node.in_flight -= 1

    # --- reading -------------------------------------------------------------

    def views(self, role: str, now: float, blocks: Sequence[int] = (),
              cache_key: str | None = None) -> list[NodeView]:  # fmt: skip
        """Every node of ``role``; ``blocks``: a prompt's keys, to fill ``cached_prefix_tokens``;
        ``cache_key``: the client's prompt_cache_key, to fill ``holds_cache_key``."""
        views = [self._view(n, now) for n in self._by_role(role)]
        keyed = self.prefixes.key_node(cache_key)
        if keyed is not None:
            views = [replace(v, holds_cache_key=v.node_id == keyed) for v in views]
        if not blocks:
            return views
        return [replace(v, cached_prefix_tokens=self.cached_prefix_tokens(v.node_id, blocks, now))
                for v in views]

    def cached_prefix_tokens(self, node_id: str, blocks: Sequence[int], now: float) -> int:
        """Tokens of a prompt the node probably holds: the index's guess, while the node's
        fresh telemetry says it keeps a prefix cache (0 when it is off or unheard of)."""
        telemetry, _ = self._fresh_telemetry(self._nodes[node_id], now)
        if telemetry.prefix_capacity_bytes <= 0:
            return 0
        return self.prefixes.cached_tokens(node_id, blocks)

    def note_adapter(self, node_id: str, name: str, digest: str | None) -> None:
        """The node answered a load (``digest``) or unload (None): routable so at once."""
        node = self._nodes.get(node_id)
        if node is not None:
            held = {k: v for k, v in node.telemetry.adapters.items() if k != name}
            held.update({name: digest} if digest is not None else {})
            node.telemetry = replace(node.telemetry, adapters=held)

    def adapters(self, node_id: str, now: float) -> Mapping[str, str]:
        """LoRA adapters (name -> digest) a serving node announced in fresh telemetry."""
        node = self._nodes[node_id]
        return self._fresh_telemetry(node, now)[0].adapters if self._serves(node) else {}

    def _serves(self, node: _Node) -> bool:
        """Healthy, and not refused by the router (another tokenizer or chat template)."""
        return node.health == NodeHealth.HEALTHY and not self.pairing.refused_by_router(
            node.node_id)

    # --- pairing -------------------------------------------------------------

    def unpaired_decodes(self, excluded: Collection[str], now: float) -> set[str]:
        """Decode nodes no serving prefill node outside ``excluded`` can hand its KV to.

        Pairs cooling down after a refused handoff count as unpaired, unless that would
        leave no decode node at all (a cooling pair is still compatible).
        """
        # Health is selection's business (it re-probes): only who may pair counts here.
        prefills = [p for p in self.ids("prefill")
                    if p not in excluded and not self.pairing.refused_by_router(p)]
        decodes = [d for d in self.ids("decode") if d not in excluded]
        if not prefills:
            return set()  # no pair to judge; selecting a prefill node will say so
        for cooling in (True, False):
            unpaired = {d for d in decodes if not any(
                self.pairing.usable(p, d, now, cooling=cooling) for p in prefills)}
            if set(decodes) - unpaired:
                return unpaired
        return unpaired

    def unpaired_prefills(self, decode_id: str, now: float) -> set[str]:
        """Prefill nodes that must not hand off to ``decode_id`` (cooling ones unless alone)."""
        prefills = self.ids("prefill")
        for cooling in (True, False):
            unpaired = {p for p in prefills
                        if not self.pairing.usable(p, decode_id, now, cooling=cooling)}
            if set(prefills) - unpaired:
                return unpaired
        return unpaired

    def _fresh_telemetry(self, node: _Node, now: float) -> tuple[NodeTelemetry, float | None]:
        if node.telemetry_at_s is None:
            return NodeTelemetry(), None
        age_s = max(0.0, now - node.telemetry_at_s)
        if age_s > self.stale_telemetry_s:
            return NodeTelemetry(), None
        return node.telemetry, age_s

    def _view(self, node: _Node, now: float) -> NodeView:
        telemetry, age_s = self._fresh_telemetry(node, now)
        return NodeView(
            node_id=node.node_id,
            address=node.address,
            healthy=self._serves(node),
            in_flight=node.in_flight,
            queue_depth=telemetry.queue_depth,
            active_sequences=telemetry.active_sequences,
            free_kv_fraction=telemetry.free_kv_fraction,
            tokens_per_s=telemetry.tokens_per_s,
            telemetry_age_s=age_s,
        )

    def stats(self, now: float, *, verbose: bool = False) -> dict[str, list[dict[str, Any]]]:
        """Snapshot for ``GET /router/stats``; addresses and errors only when ``verbose``."""
        return {
            role: [self._node_stats(n, now, verbose) for n in self._by_role(role)] for role in ROLES
        }

    def _by_role(self, role: str) -> list[_Node]:
        return [n for n in self._nodes.values() if n.role == role]

    def _pairing_stats(self, node: _Node) -> dict[str, Any]:
        """Its fingerprint summary, the nodes it pairs with, and the refusals, with reason."""
        profile = self.pairing.profiles.get(node.node_id)
        other = "decode" if node.role == "prefill" else "prefill"
        others = [] if self.pairing.refused_by_router(node.node_id) else [
            o for o in self.ids(other) if not self.pairing.refused_by_router(o)]
        return {
            "kv": profile.kv.summary() if profile is not None and profile.kv else None,
            "pairs": self.pairing.partners(node.node_id, others),
            "refused": [{"with": r.partner, "reason": r.reason}
                        for r in self.pairing.refusals_of(node.node_id)],
            "converts": self.pairing.conversions_of(node.node_id, others),  # e.g. a dtype cast
        }

    def _node_stats(self, node: _Node, now: float, verbose: bool) -> dict[str, Any]:
        telemetry, age_s = self._fresh_telemetry(node, now)
        entry: dict[str, Any] = {
            "id": node.node_id,
            "address": node.address if verbose else REDACTED,
            "health": str(node.health),
            "health_age_s": _age_s(node.health_since_s, now),
            "in_flight": node.in_flight,
            "dispatched": node.dispatched,
            "consecutive_failures": node.consecutive_failures,
            "total_failures": node.total_failures,
            "prefix_blocks": self.prefixes.blocks_held(node.node_id),  # the router's guess
            "telemetry": None if age_s is None else _telemetry_stats(telemetry, age_s),
            **self._pairing_stats(node),
        }
        if verbose:
            # Transport errors usually quote the peer's address.
            entry["last_error"] = node.last_error
        return entry
