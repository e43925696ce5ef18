"""The hook implementations mlxcel finds through the ``mlxcel`` entry point.

Each hook gets a ``register(name, obj)`` callback: the core checks names and
duplicates, so a plugin never touches a registry directly.
"""

from __future__ import annotations

from mlxcel_plugin.hookspecs import Register, hookimpl

from mlxcel_example_plugin.power_of_two import PowerOfTwoBalancer
from mlxcel_example_plugin.zlib_codec import ZlibCodec


@hookimpl
def mlxcel_register_balancers(register: Register) -> None:
    # The factory is the class itself: ``PowerOfTwoBalancer(rng)``.
    register(PowerOfTwoBalancer.name, PowerOfTwoBalancer)


@hookimpl
def mlxcel_register_kv_codecs(register: Register) -> None:
    # Codecs are stateless, so one shared instance serves every handoff.
    register(ZlibCodec.name, ZlibCodec())
