"""Where the router's nodes come from: static flags, a peers file, DNS, mdns, Kubernetes.

Each source is a plugin (``mlxcel_register_discovery``, ``router_plugin.plugin``);
``membership`` turns their snapshots into pool changes: new nodes are dialled,
vanished ones drained. ``peer_roles`` sorts ``--peers`` by handshake, at startup.
"""

from router_plugin.discovery.peer_roles import discover_pools

__all__ = ["discover_pools"]
