"""``mdns``: nodes that advertise ``_mlxcel._tcp`` on the LAN (``--advertise mdns``).

Each service is one node: its TXT ``role``, ``fp`` (model fingerprint) and
``model`` (its served model NAME: only that model's pool takes it), the
first IPv4 address it announces and its port (the link listener). A service
that goes away (the node unregisters on shutdown, or its records expire) leaves
the snapshot, and the router drains it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping

from zeroconf import IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from mlxcel_plugin.config import ServerConfig
from mlxcel_plugin.discovery_api import (
    MDNS_SERVICE_TYPE,
    NODE_ROLES,
    PROFILE_KEYS,
    DiscoveryConfig,
    Member,
    Snapshot,
    host_port,
    pinned_profile,
)
from router_plugin.discovery.served_model import MODEL_KEY, belongs, pool_model

logger = logging.getLogger(__name__)

INFO_TIMEOUT_MS = 3000


def txt(properties: Mapping[bytes, bytes | None], key: str) -> str:
    value = properties.get(key.encode())
    return value.decode(errors="replace") if value else ""


def member_from_info(info: AsyncServiceInfo, source: str = "mdns") -> Member | None:
    """The node a resolved service describes, or None (not a node, or no address yet)."""
    role = txt(info.properties, "role")
    addresses = info.parsed_addresses(IPVersion.V4Only)
    if role not in NODE_ROLES or not addresses or not info.port:
        return None
    pins = {key: txt(info.properties, key) for key in PROFILE_KEYS}
    return Member(role, host_port(addresses[0], info.port), txt(info.properties, "fp") or None,
                  source, pinned_profile(pins))


class MdnsSource:
    name = "mdns"

    def __init__(self, config: ServerConfig, discovery: DiscoveryConfig):
        self._members: dict[str, Member] = {}  # service name -> node
        self.model = pool_model(config)

    async def watch(self) -> AsyncIterator[Snapshot]:
        loop = asyncio.get_running_loop()
        changes: asyncio.Queue[tuple[str, ServiceStateChange]] = asyncio.Queue()

        def on_change(zeroconf: Zeroconf, service_type: str, name: str,
                      state_change: ServiceStateChange) -> None:
            loop.call_soon_threadsafe(changes.put_nowait, (name, state_change))

        zeroconf = AsyncZeroconf(ip_version=IPVersion.V4Only)
        browser = AsyncServiceBrowser(zeroconf.zeroconf, MDNS_SERVICE_TYPE, handlers=[on_change])
        try:
            yield frozenset()
            while True:  # until aclose()
                name, state_change = await changes.get()
                if await self._apply(zeroconf, name, state_change):
                    yield frozenset(self._members.values())
        finally:
            await browser.async_cancel()
            await zeroconf.async_close()

    async def _apply(self, zeroconf: AsyncZeroconf, name: str,
                     state_change: ServiceStateChange) -> bool:
        """Whether the snapshot changed."""
        before = self._members.get(name)
        if state_change is ServiceStateChange.Removed:
            self._members.pop(name, None)
        else:
            info = AsyncServiceInfo(MDNS_SERVICE_TYPE, name)
            if not await info.async_request(zeroconf.zeroconf, INFO_TIMEOUT_MS):
                logger.warning("mdns: %s did not answer with its address", name)
                return False
            member = member_from_info(info, self.name)
            if member is None or not belongs(txt(info.properties, MODEL_KEY), self.model):
                self._members.pop(name, None)
            else:
                self._members[name] = member
        return self._members.get(name) != before
