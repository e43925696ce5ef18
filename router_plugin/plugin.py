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
