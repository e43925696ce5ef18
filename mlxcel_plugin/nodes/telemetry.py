"""TELEMETRY on a router link: once when it opens, then every ``interval_s``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from mlxcel_plugin.link import Link, LinkClosed
from mlxcel_plugin.link.protocol.frames import Telemetry

logger = logging.getLogger(__name__)
DEFAULT_INTERVAL_S = 0.5


async def send_telemetry(link: Link, snapshot: Callable[[], Telemetry],
                         interval_s: float = DEFAULT_INTERVAL_S) -> None:
    """Runs until the link closes (cancel it to stop earlier)."""
    try:
        while not link.closed:  # ends with the link
            await link.send(snapshot().to_frame())
            await asyncio.sleep(interval_s)
    except LinkClosed:
        logger.debug("telemetry to %s stops: link closed", link.peer_node_id)
