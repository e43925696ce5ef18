"""The router's built-in plugin: registered through the ``mlxcel`` entry point ``router``."""

from __future__ import annotations

from mlxcel_plugin.hookspecs import Register, hookimpl
from router_plugin.balancers import BUILTIN_BALANCERS


@hookimpl
def mlxcel_register_balancers(register: Register) -> None:
    for name, factory in BUILTIN_BALANCERS.items():
        register(name, factory)


# --- roles -------------------------------------------------------------------
# The lead registers the ``router`` role here, e.g.:
#
# @hookimpl
# def mlxcel_register_roles(register: Register) -> None:
#     register("router", run_router)
