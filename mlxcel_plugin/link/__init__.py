"""Links: authenticated, encrypted, bidirectional frame streams between nodes.

``protocol/`` is the sans-I/O half (handshake, records, frames). Beside it,
the asyncio half: ``connection`` (one ``Link``; its ``config`` and close codes,
and ``bodies``, the buffers it sends from and receives into), ``writer`` (its send queue),
``bulk`` (the side channel for large bodies), ``delivery`` (in-order hand-off
to a consumer), ``send_budget``, ``dial`` (client side, with backoff) and
``server`` (listener). Nodes and the router import what they need from here.
"""

from mlxcel_plugin.link.connection import Link, LinkClosed, LinkConfig
from mlxcel_plugin.link.dial import RETRYABLE, Backoff, dial_link, dial_with_backoff
from mlxcel_plugin.link.protocol.secret import (
    ClusterSecret,
    generate_secret_file,
    load_cluster_secret,
    require_cluster_secret,
)
from mlxcel_plugin.link.server import LinkServer, serve_links

__all__ = [
    "RETRYABLE",
    "Backoff",
    "ClusterSecret",
    "Link",
    "LinkClosed",
    "LinkConfig",
    "LinkServer",
    "dial_link",
    "dial_with_backoff",
    "generate_secret_file",
    "load_cluster_secret",
    "require_cluster_secret",
    "serve_links",
]
