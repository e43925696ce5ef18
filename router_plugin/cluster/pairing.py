"""Which prefill node may hand its KV to which decode node, known before any request.

Pure bookkeeping, fed by the links (each node's announced ``NodeProfile``) and
by refused handoffs (a pair cools down), read by selection. A node is refused
by the router when its tokenizer or chat template differs from the router's; a
pair (prefill, decode) is refused when the decode node cannot take the prefill
node's KV (``compatibility.kv_refusal``); a pair whose KV converts on the way
(another dtype; plain K/V to a ``kv_bits`` decode node) is formed and says how
(``conversions_of``); a pair whose handoff was refused at run time cools down
with backoff. Each refusal is counted once, by reason.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from mlxcel_plugin.compatibility import NodeProfile, kv_conversion, kv_refusal, text_refusal

ROUTER = "router"  # the partner named in a node-level refusal
DEFAULT_COOLDOWN_S = 1.0
DEFAULT_MAX_COOLDOWN_S = 30.0


@dataclass(frozen=True)
class Refusal:
    node_id: str
    partner: str  # the other node's id, or ROUTER
    reason: str

    @property
    def key(self) -> tuple[str, str, str]:
        """The same for a pair whichever side reports it: counted once."""
        return (*sorted((self.node_id, self.partner)), self.reason)  # type: ignore[return-value]


@dataclass
class _Cooldown:
    strikes: int = 0
    until_s: float = 0.0


class PairingTable:
    """Profiles by node id, the refusals they imply, and cooling pairs."""

    def __init__(self, router: NodeProfile | None = None, *,
                 cooldown_s: float = DEFAULT_COOLDOWN_S,
                 max_cooldown_s: float = DEFAULT_MAX_COOLDOWN_S):
        # The router's own tokenizer and template digests (None: unknown, refuses nobody).
        self.router = router if router is not None else NodeProfile()
        self.cooldown_s, self.max_cooldown_s = cooldown_s, max_cooldown_s
        self.profiles: dict[str, NodeProfile] = {}
        self.roles: dict[str, str] = {}
        self.known: set[tuple[str, str, str]] = set()  # refusals seen, to count each once
        self.reason_counts: Counter[str] = Counter()
        self._cooldowns: dict[tuple[str, str], _Cooldown] = {}

    # ------------------------------------------------------------ profiles

    def set_profile(self, node_id: str, role: str, profile: NodeProfile) -> list[Refusal]:
        """A node (re)announced itself; returns the refusals that are new."""
        self.profiles[node_id], self.roles[node_id] = profile, role
        new = [r for r in self.refusals_of(node_id) if r.key not in self.known]
        for refusal in new:
            self.known.add(refusal.key)
            self.reason_counts[refusal.reason] += 1
        return new

    def forget(self, node_id: str) -> None:
        self.profiles.pop(node_id, None)
        self.roles.pop(node_id, None)
        self._cooldowns = {pair: c for pair, c in self._cooldowns.items() if node_id not in pair}

    def refused_by_router(self, node_id: str) -> str | None:
        profile = self.profiles.get(node_id)
        return None if profile is None else text_refusal(profile, self.router)

    def pair_refusal(self, prefill_id: str, decode_id: str) -> str | None:
        """Why ``decode_id`` cannot take ``prefill_id``'s KV; None when it can (or unknown)."""
        sender, receiver = self.profiles.get(prefill_id), self.profiles.get(decode_id)
        if sender is None or receiver is None:
            return None
        return kv_refusal(sender.kv, receiver.kv)

    def refusals_of(self, node_id: str) -> list[Refusal]:
        """This node's refusals now: by the router, and with every node of the other role."""
        found = []
        reason = self.refused_by_router(node_id)
        if reason is not None:
            found.append(Refusal(node_id, ROUTER, reason))
        role = self.roles.get(node_id)
        for other, other_role in self.roles.items():
            if other_role == role:
                continue
            pair = (node_id, other) if role == "prefill" else (other, node_id)
            reason = self.pair_refusal(*pair)
            if reason is not None:
                found.append(Refusal(node_id, other, reason))
        return found

    def partners(self, node_id: str, others: Iterable[str]) -> list[str]:
        """Of ``others`` (the other role's ids), those this node pairs with."""
        if self.roles.get(node_id) == "decode":
            return [o for o in others if self.pair_refusal(o, node_id) is None]
        return [o for o in others if self.pair_refusal(node_id, o) is None]

    def conversions_of(self, node_id: str, others: Iterable[str]) -> list[dict[str, str]]:
        """Of its pairs with ``others``, those whose KV converts on the way, and how."""
        found = []
        for other in self.partners(node_id, others):
            pair = (other, node_id) if self.roles.get(node_id) == "decode" else (node_id, other)
            sender, receiver = (self.profiles.get(i) for i in pair)
            how = kv_conversion(sender and sender.kv, receiver and receiver.kv)
            if how:
                found.append({"with": other, "converts": how})
        return found

    # ------------------------------------------------------------ cooldowns

    def cool(self, prefill_id: str, decode_id: str, now: float) -> float:
        """A handoff of this pair was refused: no new request for a while (doubling)."""
        cooldown = self._cooldowns.setdefault((prefill_id, decode_id), _Cooldown())
        cooldown.strikes += 1
        delay_s = min(self.cooldown_s * 2 ** (cooldown.strikes - 1), self.max_cooldown_s)
        cooldown.until_s = now + delay_s
        return delay_s

    def cooling(self, prefill_id: str, decode_id: str, now: float) -> bool:
        cooldown = self._cooldowns.get((prefill_id, decode_id))
        return cooldown is not None and now < cooldown.until_s

    def succeeded(self, prefill_id: str, decode_id: str) -> None:
        """A handoff of this pair landed: its next refusal starts the backoff over."""
        self._cooldowns.pop((prefill_id, decode_id), None)

    def usable(self, prefill_id: str, decode_id: str, now: float, *, cooling: bool) -> bool:
        """May this pair take a request? ``cooling``: also skip pairs cooling down."""
        if self.pair_refusal(prefill_id, decode_id) is not None:
            return False
        return not (cooling and self.cooling(prefill_id, decode_id, now))
