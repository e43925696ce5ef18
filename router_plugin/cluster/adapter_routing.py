"""Which nodes may run a request on a LoRA adapter, from what the nodes announce.

Each prefill and decode node announces the adapters it holds (name -> digest
of the adapter's files) in its telemetry (``mlxcel_plugin/nodes/node_adapters.py``).
A request on adapter X runs only on a pair that both hold X at one digest: the
prefill node's K/V are X's, and the decode node continues them with X. The
router picks that digest (the one most decode nodes hold), leaves every node
without it out of the selection, and names it in the REQUEST and the claim, so
a node that changed meanwhile refuses before any work (``adapter_not_loaded``).
An adapter no pair holds is a 404 ``model_not_found``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import replace

from mlxcel_plugin.errors import ModelNotFoundError
from mlxcel_plugin.link.protocol.frames import Request
from router_plugin.cluster.node_pool import NodePool
from router_plugin.cluster.stream_bridge import DECODE, PREFILL


def _digests(pool: NodePool, role: str, name: str, now: float) -> Counter[str]:
    held = (pool.adapters(node_id, now).get(name) for node_id in pool.ids(role))
    return Counter(digest for digest in held if digest is not None)


def adapter_digest(pool: NodePool, name: str, now: float) -> str:
    """The digest of ``name`` a prefill and a decode node both hold (most decode nodes' first)."""
    prefills = _digests(pool, PREFILL, name, now)
    for digest, _ in sorted(_digests(pool, DECODE, name, now).items(),
                            key=lambda item: (-item[1], item[0])):  # fmt: skip
        if digest in prefills:
            return digest
    raise ModelNotFoundError(f"the model {name!r} does not exist: no prefill and decode node "
                             "pair serves that adapter", param="model")  # fmt: skip


def lacking_adapter(pool: NodePool, name: str | None, digest: str | None,
                    now: float) -> set[str]:  # fmt: skip
    """Nodes (both roles) that do not hold ``name`` at ``digest``; none for the base."""
    if name is None:
        return set()
    return {node_id for role in (PREFILL, DECODE) for node_id in pool.ids(role)
            if pool.adapters(node_id, now).get(name) != digest}  # fmt: skip


def adapter_placement(pool: NodePool, name: str | None, now: float) -> tuple[str | None, set[str]]:
    """(the digest a request on ``name`` runs at, the nodes left out); (None, {}) for the base."""
    if name is None:
        return None, set()
    digest = adapter_digest(pool, name, now)
    return digest, lacking_adapter(pool, name, digest, now)


def with_adapter(frame: Request, name: str | None, digest: str | None) -> Request:
    """The REQUEST or claim naming the adapter: each node checks it holds it at ``digest``."""
    return frame if name is None else replace(frame, adapter=name, adapter_digest=digest)


class ServedAdapters(Mapping[str, str]):
    """The front's view (adapter name -> its base) of what a prefill/decode pair holds now."""

    def __init__(self, pool: NodePool, base: str, clock: object):
        self.pool, self.base, self.clock = pool, base, clock

    def _names(self) -> set[str]:
        now = self.clock()
        by_role = [{name for node_id in self.pool.ids(role)
                    for name in self.pool.adapters(node_id, now)}
                   for role in (PREFILL, DECODE)]  # fmt: skip
        return by_role[0] & by_role[1]

    def __getitem__(self, name: str) -> str:
        if name not in self._names():
            raise KeyError(name)
        return self.base

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._names()))

    def __len__(self) -> int:
        return len(self._names())
