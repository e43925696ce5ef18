"""``--peers``: learn each static peer's role from its handshake, once, at startup.

The router dials every address as role ``router``; the handshake tells it
whether the node serves prefill or decode, and the address joins that pool
(on top of ``--prefill-peers`` / ``--decode-peers``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from mlxcel_plugin.config import ServerConfig
from mlxcel_plugin.errors import ConfigError
from mlxcel_plugin.link import Backoff, ClusterSecret, dial_with_backoff

logger = logging.getLogger(__name__)

NODE_ROLES = ("prefill", "decode")
DISCOVERY_TIMEOUT_S = 60.0  # nodes may still be loading their model


async def learn_role(address: str, secret: ClusterSecret, node_id: str) -> str:
    link = await dial_with_backoff(
        address, secret, "router", node_id, expect_roles=NODE_ROLES,
        backoff=Backoff(), max_attempts=1_000,
    )  # fmt: skip
    role = link.peer_role
    await link.close()
    return role


async def learn_roles(
    addresses: tuple[str, ...], secret: ClusterSecret, node_id: str, timeout_s: float
) -> dict[str, str]:
    async def one(address: str) -> tuple[str, str]:
        try:
            return address, await asyncio.wait_for(learn_role(address, secret, node_id), timeout_s)
        except TimeoutError:
            message = f"--peers: no handshake with {address} within {timeout_s:.0f}s"
            raise ConfigError(message) from None

    return dict(await asyncio.gather(*(one(address) for address in addresses)))


def _merge(known: tuple[str, ...], found: list[str]) -> tuple[str, ...]:
    return known + tuple(address for address in found if address not in known)


def discover_pools(
    config: ServerConfig, secret: ClusterSecret, timeout_s: float = DISCOVERY_TIMEOUT_S
) -> ServerConfig:
    """``config`` with ``--peers`` sorted into the prefill and decode pools."""
    if not config.peers:
        return config
    roles = asyncio.run(learn_roles(config.peers, secret, config.effective_node_id, timeout_s))
    for address, role in roles.items():
        logger.info("--peers: %s is a %s node", address, role)
    by_role = {role: [a for a in config.peers if roles[a] == role] for role in NODE_ROLES}
    config = replace(
        config,
        prefill_peers=_merge(config.prefill_peers, by_role["prefill"]),
        decode_peers=_merge(config.decode_peers, by_role["decode"]),
    )
    for role in NODE_ROLES:
        if not getattr(config, f"{role}_peers"):
            raise ConfigError(f"the router found no {role} node among --peers and --{role}-peers")
    return config
