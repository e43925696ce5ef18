"""The router's built-in plugin: registered through the ``mlxcel`` entry point ``router``."""

from __future__ import annotations

from mlxcel_plugin.hookspecs import Register, hookimpl
from router_plugin.balancers import BUILTIN_BALANCERS


@hookimpl
def mlxcel_register_balancers(register: Register) -> None:
    for name, factory in BUILTIN_BALANCERS.items():
        register(name, factory)


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
