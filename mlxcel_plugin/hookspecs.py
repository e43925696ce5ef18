"""Hook specifications: the only way engines and strategies enter the system.

Every hook receives a ``register`` callback so the core keeps control of
names, duplicates and validation. Built-ins are plugins like any other; a
third-party package exposes a module through the ``mlxcel`` entry-point group::

    [project.entry-points.mlxcel]
    my_plugin = "my_package.plugin"
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT_NAME = "mlxcel"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Register = Callable[[str, Any], None]


@hookspec
def mlxcel_register_engines(register: Register) -> None:
    """Register engine factories.

    :param register: ``register(name, factory)``; ``factory(model_path: str,
        config: EngineConfig) -> Engine`` (see ``mlxcel_plugin.engine_api``).
    :return: nothing; call ``register`` once per engine.

    All implementations are called. Example::

        @hookimpl
        def mlxcel_register_engines(register):
            register("mlx", make_mlx_engine)
    """


@hookspec
def mlxcel_register_balancers(register: Register) -> None:
    """Register load-balancing strategies.

    :param register: ``register(name, factory)``; ``factory(rng:
        random.Random) -> Balancer`` with ``name`` and ``select(candidates,
        request) -> NodeView`` (see ``mlxcel_plugin.balancer_api``). Every
        random draw comes from ``rng``: the router passes one per pool, seeded
        from ``[router] seed``. The name is the config value of
        ``--prefill-balancer`` / ``--decode-balancer``.
    :return: nothing.

    All implementations are called. Example::

        @hookimpl
        def mlxcel_register_balancers(register):
            register("power-of-two", PowerOfTwoBalancer)
    """


@hookspec
def mlxcel_register_transfer_strategies(register: Register) -> None:
    """Register KV transfer strategies.

    :param register: ``register(name, factory)``; ``factory(options:
        StrategyOptions) -> TransferStrategy``, one instance per handoff, with
        ``start(header)``, ``add_layer(i, layer)`` and ``finish()`` each
        returning KV messages (see ``mlxcel_plugin.transfer.base``).
    :return: nothing.

    All implementations are called. Example::

        @hookimpl
        def mlxcel_register_transfer_strategies(register):
            register("full", FullTransfer)
    """


@hookspec
def mlxcel_register_kv_codecs(register: Register) -> None:
    """Register KV codecs (compression, quantization).

    :param register: ``register(name, codec)``; ``codec`` has ``name``,
        ``lossless``, ``profile`` and implements ``encode(array, dtype,
        layout=None) -> (bytes, meta)`` / ``decode(bytes, meta, shape, dtype)
        -> array`` (``layout``: K or V, tokens per head, first row; see
        ``mlxcel_plugin.kv_codecs.base``). Names compose: ``int8+lz4``.
    :return: nothing.

    All implementations are called. Example::

        @hookimpl
        def mlxcel_register_kv_codecs(register):
            register("zstd", ZstdCodec())
    """


@hookspec
def mlxcel_register_roles(register: Register) -> None:
    """Register serving roles (``--node-role``).

    :param register: ``register(name, run)``; ``run(config: ServerConfig,
        plugins: PluginRegistry) -> None`` blocks serving until shutdown.
    :return: nothing.

    All implementations are called. Example::

        @hookimpl
        def mlxcel_register_roles(register):
            register("hybrid", run_hybrid)
    """


@hookspec
def mlxcel_register_discovery(register: Register) -> None:
    """Register discovery sources: where the router learns its nodes at runtime.

    :param register: ``register(name, factory)``; ``factory(config: ServerConfig,
        discovery: DiscoveryConfig) -> DiscoverySource`` with ``name`` and
        ``watch()``, an async iterator of full ``frozenset[Member]`` snapshots
        (see ``mlxcel_plugin.discovery_api``). The name is a ``--discovery`` value;
        the router dials what a source finds with the cluster secret, like any peer.
    :return: nothing.

    All implementations are called. Example::

        @hookimpl
        def mlxcel_register_discovery(register):
            register("consul", ConsulSource)
    """
