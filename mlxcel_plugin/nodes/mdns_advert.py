"""``--advertise mdns``: a prefill or decode node announces ``_mlxcel._tcp`` on the LAN.

The service's port is the link listener's; its TXT record carries the node's
role, id and model fingerprint (``discovery_api.model_fingerprint``), which a
router started with ``--discovery mdns`` reads to add the node to its pool (and
to refuse one serving another model). Advertising grants nothing: the router
still handshakes with the cluster secret before it sends a request.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

from zeroconf import IPVersion, ServiceInfo
from zeroconf.asyncio import AsyncZeroconf

from mlxcel_plugin.compatibility import NodeProfile
from mlxcel_plugin.config import ServerConfig, parse_host_port
from mlxcel_plugin.discovery_api import MDNS_SERVICE_TYPE, model_fingerprint

logger = logging.getLogger(__name__)

ANY_HOST = ("0.0.0.0", "::", "")
MAX_INSTANCE_BYTES = 63  # DNS label limit
MAX_TXT_BYTES = 250  # one TXT string is at most 255 bytes, "key=" included


def instance_name(node_id: str) -> str:
    """A DNS-SD instance label from the node id (dots would split it)."""
    label = node_id.replace(".", "-")
    return label.encode()[:MAX_INSTANCE_BYTES].decode(errors="ignore")


def service_info(config: ServerConfig, node_id: str,
                 profile: NodeProfile | None = None) -> ServiceInfo:
    host, port = parse_host_port(config.serving_bind or "")
    # A wildcard bind: zeroconf announces every interface's address.
    addresses = None if host in ANY_HOST else [host]
    # "model": its served NAME, which a several-model router's pools sort nodes by.
    properties = {"role": config.role, "node": node_id,
                  "fp": model_fingerprint(config.model) or "",
                  "model": config.served_model_name or Path(config.model or "").name}
    # Its tokenizer/template digests and KV summary (each TXT string holds 255 bytes).
    pins = profile.to_announce() if profile is not None else {}
    properties.update({k: v for k, v in pins.items() if len(v.encode()) <= MAX_TXT_BYTES})
    return ServiceInfo(MDNS_SERVICE_TYPE, f"{instance_name(node_id)}.{MDNS_SERVICE_TYPE}",
                       port=port, properties=properties, parsed_addresses=addresses,
                       server=f"{socket.gethostname()}.local.")


class MdnsAdvert:
    def __init__(self, zeroconf: AsyncZeroconf, info: ServiceInfo):
        self._zeroconf, self.info = zeroconf, info

    @classmethod
    async def start(cls, config: ServerConfig, node_id: str,
                    profile: NodeProfile | None = None) -> MdnsAdvert:
        zeroconf = AsyncZeroconf(ip_version=IPVersion.V4Only)
        info = service_info(config, node_id, profile)
        await zeroconf.async_register_service(info)
        logger.info("advertising %s on mdns as %s", node_id, info.name)
        return cls(zeroconf, info)

    async def close(self) -> None:
        await self._zeroconf.async_unregister_service(self.info)
        await self._zeroconf.async_close()


async def advertise(config: ServerConfig, node_id: str,
                    profile: NodeProfile | None = None) -> MdnsAdvert | None:
    """Start advertising when ``--advertise mdns``; None otherwise."""
    if config.advertise != "mdns":
        return None
    return await MdnsAdvert.start(config, node_id, profile)
