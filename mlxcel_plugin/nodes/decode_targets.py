"""Which decode node a prefill node hands its KV to, and in which dtype (docs/compatibility.md).

A decode node announces its KV profile in its link verdict; the prefill node
learns it from the first link it dials to that node (before that request's
prefill starts). It then hands off only to a node that can take its KV:

* its own ``--decode-peers`` (no ``decode_target`` from the router): the next
  one in turn that is not known to be incompatible;
* the router's ``decode_target``: taken when allowed; a target known to be
  incompatible is refused (``refusal``) before any KV is sent, and the node
  reports it with the named code ``decode_target_incompatible`` once its first
  token is out, so the router places the request on another pair.

``wire_dtype`` is the dtype the K/V travel in: the decode node's when it is no
wider than ours (we cast before sending), else ours (it widens on arrival).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from mlxcel_plugin.compatibility import KVProfile, NodeProfile, kv_conversion, kv_refusal
from mlxcel_plugin.errors import MlxcelError
from mlxcel_plugin.kv_serde.convert import QUANTIZED_KIND, wire_dtype
from mlxcel_plugin.nodes.decode_allowlist import DecodeAllowlist

logger = logging.getLogger(__name__)

INCOMPATIBLE = "decode_target_incompatible"


class _Links(Protocol):
    async def lanes(self, target: str, count: int) -> list[Any]: ...


class DecodeTargets:
    """The decode nodes this prefill node may hand off to, with their announced profiles."""

    def __init__(self, own: KVProfile | None, peers: Sequence[str], allowlist: DecodeAllowlist,
                 node_id: str = "prefill"):
        self.own, self.peers, self.allowlist, self.node_id = own, tuple(peers), allowlist, node_id
        self.profiles: dict[str, KVProfile | None] = {}  # by address; None: announced none
        self._cycle = itertools.cycle(self.peers) if self.peers else None

    def known(self, target: str) -> bool:
        return target in self.profiles

    def refusal(self, target: str) -> str | None:
        """Why ``target`` cannot take our KV (None: it can, or its profile is unknown)."""
        return kv_refusal(self.own, self.profiles.get(target))

    def choose(self, wanted: str | None) -> tuple[str, bool]:
        """(target, pinned): the router's target when allowed, else our next compatible peer."""
        if wanted:
            if not self.allowlist.allows(wanted):
                raise MlxcelError(f"decode target {wanted} is not allowed",
                                  code="decode_target_refused")
            return wanted, True
        if self._cycle is None:
            raise MlxcelError("no decode_target and no --decode-peers", code="no_decode_target")
        for _ in self.peers:  # one turn at most
            peer = next(self._cycle)
            if self.refusal(peer) is None:
                return peer, False
        raise MlxcelError("none of --decode-peers can take this node's KV "
                          f"({', '.join(f'{p}: {self.refusal(p)}' for p in self.peers)})",
                          code=INCOMPATIBLE)

    def refused_error(self, target: str) -> MlxcelError:
        return MlxcelError(f"decode node {target} cannot take this node's KV: "
                           f"{self.refusal(target)}", code=INCOMPATIBLE)

    def wire_dtype(self, target: str, sender_dtype: str,
                   sender_kinds: Sequence[str] = ()) -> str:
        """The dtype our K/V go to ``target`` in (packed, quantized K/V are never cast)."""
        receiver = self.profiles.get(target)
        if receiver is None or QUANTIZED_KIND in sender_kinds:
            return sender_dtype
        return wire_dtype(sender_dtype, receiver.dtype)

    def learned(self, target: str, announce: Mapping[str, str]) -> None:
        """A link to ``target`` is up: keep what its verdict announced."""
        profile = NodeProfile.from_announce(announce).kv
        if target not in self.profiles or self.profiles[target] != profile:
            self._log(target, profile)
        self.profiles[target] = profile

    async def learn(self, target: str, links: _Links) -> None:
        """Dial ``target`` (or reuse its link) to read its profile; unknown if it cannot."""
        try:
            (link,) = await links.lanes(target, 1)
        except Exception as exc:  # noqa: BLE001 - unreachable now: the handoff will say so
            logger.info("%s: no link to decode node %s yet: %r", self.node_id, target, exc)
            return
        self.learned(target, getattr(link, "peer_announce", {}) or {})

    def _log(self, target: str, profile: KVProfile | None) -> None:
        refusal, how = kv_refusal(self.own, profile), kv_conversion(self.own, profile)
        summary = profile.summary() if profile is not None else "no profile"
        if refusal is not None:
            logger.warning("%s: decode node %s (%s) cannot take this node's KV: %s",
                           self.node_id, target, summary, refusal)
        elif how:
            logger.info("%s: handoffs to decode node %s (%s) convert: %s", self.node_id, target,
                        summary, how)
