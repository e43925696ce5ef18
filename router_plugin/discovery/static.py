"""``static``: the nodes named by ``--prefill-peers`` / ``--decode-peers`` (and ``--peers``).

They never change; ``dns:`` entries are left to the ``dns`` source.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from mlxcel_plugin.config import ServerConfig
from mlxcel_plugin.discovery_api import DiscoveryConfig, Member, Snapshot, is_dns_entry


def static_members(config: ServerConfig, source: str = "static") -> Snapshot:
    entries = [("prefill", a) for a in config.prefill_peers]
    entries += [("decode", a) for a in config.decode_peers]
    return frozenset(Member(role, address, source=source) for role, address in entries
                     if not is_dns_entry(address))


class StaticSource:
    name = "static"

    def __init__(self, config: ServerConfig, discovery: DiscoveryConfig):
        self.members = static_members(config, self.name)

    async def watch(self) -> AsyncIterator[Snapshot]:
        yield self.members
        await asyncio.Event().wait()  # nothing ever changes; aclose() ends it
