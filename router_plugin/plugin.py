"""The router's built-in plugin (entry point ``router``): its balancers and the HTTP roles.

Registered through the same hooks as any third-party plugin; this is the only
place the built-in balancers are listed.
"""

from __future__ import annotations

from mlxcel_plugin.hookspecs import Register, hookimpl
from router_plugin.balancers import (
    LeastLoadedBalancer,
    MemoryAwareBalancer,
    PrefixAwareBalancer,
    PromptLengthAwareBalancer,
    RoundRobinBalancer,
)

BALANCERS = (
    RoundRobinBalancer,
    LeastLoadedBalancer,
    MemoryAwareBalancer,
    PromptLengthAwareBalancer,
    PrefixAwareBalancer,
)


@hookimpl
def mlxcel_register_balancers(register: Register) -> None:
    # The class is the factory: ``Balancer(rng)``.
    for balancer in BALANCERS:
        register(balancer.name, balancer)


def run_hybrid(config, registry) -> None:
    # Imported on use: prefill/decode nodes load this plugin too and need no FastAPI.
    from router_plugin.roles import run_hybrid as run

    run(config, registry)


def run_router(config, registry) -> None:
    from router_plugin.roles import run_router as run

    run(config, registry)


@hookimpl
def mlxcel_register_roles(register: Register) -> None:
    register("hybrid", run_hybrid)
    register("router", run_router)


def make_static_source(config, discovery):
    # Imported on use, like the roles: nodes load this plugin and run no discovery.
    from router_plugin.discovery.static import StaticSource

    return StaticSource(config, discovery)


def make_file_source(config, discovery):
    from router_plugin.discovery.peers_file import PeersFileSource

    return PeersFileSource(config, discovery)


def make_dns_source(config, discovery):
    from router_plugin.discovery.dns import DnsSource

    return DnsSource(config, discovery)


def make_mdns_source(config, discovery):
    from router_plugin.discovery.mdns import MdnsSource

    return MdnsSource(config, discovery)


def make_kubernetes_source(config, discovery):
    from router_plugin.discovery.kubernetes import KubernetesSource

    return KubernetesSource(config, discovery)


DISCOVERY_SOURCES = {
    "static": make_static_source,
    "file": make_file_source,
    "dns": make_dns_source,
    "mdns": make_mdns_source,
    "kubernetes": make_kubernetes_source,
}


@hookimpl
def mlxcel_register_discovery(register: Register) -> None:
    for name, factory in DISCOVERY_SOURCES.items():
        register(name, factory)
