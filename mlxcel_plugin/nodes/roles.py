"""``run_prefill`` / ``run_decode``: the role entry points (``mlxcel_register_roles``).

Each loads the cluster secret (refusing to start without one), builds the
engine through the plugin registry, serves links on ``--serving-bind`` and
``/health`` + ``/metrics`` on ``--host:--port`` (``ops_server``), and on
SIGTERM/SIGINT drains (``drain``: no new work, in-flight requests finish,
at most ``[node] drain_timeout_s``), then shuts down cleanly and exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import asdict, dataclass, replace
from typing import Any

from mlxcel_plugin.compatibility import (
    KVProfile,
    NodeProfile,
    chat_template_digest,
    tokenizer_digest,
)
from mlxcel_plugin.config import DEFAULT_INGEST_NICE, ServerConfig, dataclass_from_mapping
from mlxcel_plugin.discovery_api import model_fingerprint
from mlxcel_plugin.engine_api import Engine, EngineConfig
from mlxcel_plugin.gc_pauses import freeze_startup_heap
from mlxcel_plugin.kv_codecs import resolve_codec
from mlxcel_plugin.link import ClusterSecret, Link, LinkConfig, require_cluster_secret, serve_links
from mlxcel_plugin.link.config import bulk_lanes_for
from mlxcel_plugin.loop_stalls import LoopWatchdog
from mlxcel_plugin.memory_budget import engine_config_of, engine_model_bytes
from mlxcel_plugin.nodes.decode_node import DecodeNode, DecodeNodeParts
from mlxcel_plugin.nodes.drain import DEFAULT_DRAIN_TIMEOUT_S, NodeDrain, StopSignals, wait_drained
from mlxcel_plugin.nodes.handoff_sender import DecodeLinks
from mlxcel_plugin.nodes.kv_wire import KV_SERDE_ANNOUNCE, announce_serde_versions
from mlxcel_plugin.nodes.mdns_advert import advertise
from mlxcel_plugin.nodes.ops_server import OpsRoutes, OpsServer
from mlxcel_plugin.nodes.prefill_node import PrefillNode, PrefillNodeParts
from mlxcel_plugin.nodes.telemetry import send_telemetry
from mlxcel_plugin.plugins import PluginRegistry
from mlxcel_plugin.scheduling import DecodeSchedulerConfig, PrefillSchedulerConfig
from mlxcel_plugin.transfer import AUTO, TransferConfig

logger = logging.getLogger(__name__)

UNCHUNKED_TOKENS = 1 << 30
TELEMETRY_SECTION = "node"


@dataclass(frozen=True)
class NodeSettings:
    """TOML section ``[node]``: settings both node kinds share."""

    telemetry_interval_s: float = 0.5
    max_links: int = 64
    # After SIGTERM, in-flight requests get this long to finish; the rest are cancelled
    # (their routers migrate them).
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S


def transfer_config(config: ServerConfig) -> TransferConfig:
    return TransferConfig.from_dict(dict(config.section("transfer")))


def prefill_scheduler_config(config: ServerConfig,
                             transfer: TransferConfig) -> PrefillSchedulerConfig:
    """``[prefill_scheduler]`` over the engine's chunking; ``[transfer]`` timeout wins."""
    section = dict(config.section("prefill_scheduler"))
    base = asdict(PrefillSchedulerConfig.from_engine_config(config.engine_config))
    if "transfer_timeout_s" in config.section("transfer"):
        section["transfer_timeout_s"] = transfer.transfer_timeout_s
    return dataclass_from_mapping(PrefillSchedulerConfig, {**base, **section},
                                  "[prefill_scheduler]")


def prefill_engine_config(config: ServerConfig, sched: PrefillSchedulerConfig) -> EngineConfig:
    """The engine chunks as the scheduler says (hybrid must use the same chunk size)."""
    chunk = sched.chunk_size_tokens if sched.chunked_prefill_enabled else UNCHUNKED_TOKENS
    return replace(config.engine_config, chunk_size_tokens=chunk)


def decode_scheduler_config(config: ServerConfig,
                            engine_config: EngineConfig | None = None) -> DecodeSchedulerConfig:
    """``[decode_scheduler]`` over the engine's limits (``engine_config``: its sized budget)."""
    engine_config = engine_config_of(None, engine_config or config.engine_config)
    base = asdict(DecodeSchedulerConfig.from_engine_config(engine_config))
    return dataclass_from_mapping(DecodeSchedulerConfig,
                                  {**base, **config.section("decode_scheduler")},
                                  "[decode_scheduler]")


# KV chunks from this size on take the bulk channel: decrypted off the event loop, into
# the assembler's buffers, without the GIL, instead of on the loop the batch shares.
KV_BULK_THRESHOLD_BYTES = 32 * 1024


def link_config(role: str, bulk_lanes: int = 0,
                ingest_nice: int = DEFAULT_INGEST_NICE) -> LinkConfig:
    """The links a node serves: a decode node receives KV bodies at niceness ``ingest_nice``
    (``--ingest-nice``: ingestion runs on what its decode batch leaves of a busy core);
    ``bulk_lanes`` (``--bulk-lanes``; 0: one per core up to 4) bounds the lanes it grants."""
    return LinkConfig(bulk_reader_nice=ingest_nice if role == "decode" else 0,
                      bulk_max_lanes=bulk_lanes_for(bulk_lanes))


def kv_link_config(bulk_lanes: int = 0) -> LinkConfig:
    """Links a prefill node dials to decode nodes to hand KV caches over: bodies spread
    over parallel bulk lanes (``--bulk-lanes`` / ``MLXCEL_BULK_LANES``, else one per core
    up to 4)."""
    # The send queue stays at its default (32 MiB: one full KV frame at a time), so
    # lanes overlap consecutive bodies (the next one sealed and sent on another lane while
    # the last drains and is read) rather than carry several at once: with room for a frame
    # per lane, 8k-token handoffs got slower here (the decode node's receive is the limit).
    return LinkConfig(bulk_threshold_bytes=KV_BULK_THRESHOLD_BYTES,
                      bulk_lanes=bulk_lanes_for(bulk_lanes))


def node_settings(config: ServerConfig) -> NodeSettings:
    return dataclass_from_mapping(NodeSettings, config.section(TELEMETRY_SECTION), "[node]")


def _check_transfer_names(transfer: TransferConfig, registry: PluginRegistry) -> None:
    """Unknown strategy or codec names fail at startup, listing the registered ones."""
    if transfer.strategy != AUTO:
        registry.get("transfer_strategy", transfer.strategy)
    if transfer.codec != AUTO:
        resolve_codec(transfer.codec, registry.entries.get("kv_codec", {}))


def _build_engine(config: ServerConfig, registry: PluginRegistry,
                  engine_config: EngineConfig) -> Engine:
    return registry.get("engine", config.engine)(config.model, engine_config)


# -- prefill --------------------------------------------------------------------------


def run_prefill(config: ServerConfig, registry: PluginRegistry) -> None:
    secret = require_cluster_secret("prefill", config.cluster_secret_file, os.environ)
    transfer = transfer_config(config)
    _check_transfer_names(transfer, registry)
    sched = prefill_scheduler_config(config, transfer)
    engine = _build_engine(config, registry, prefill_engine_config(config, sched))
    parts = PrefillNodeParts(
        engine=engine, scheduler_config=sched,
        transfer_config=replace(transfer, transfer_timeout_s=sched.transfer_timeout_s),
        strategies=registry.entries.get("transfer_strategy", {}),
        codecs=registry.entries.get("kv_codec", {}), decode_peers=config.decode_peers,
        kv_budget_bytes=engine_config_of(engine, config.engine_config).kv_memory_bytes,
        kv_profile=node_profile(config, engine).kv,
    )

    def build() -> PrefillNode:
        node_id = config.effective_node_id
        links = DecodeLinks(secret, node_id, kv_link_config(config.bulk_lanes))
        return PrefillNode(parts, links, node_id)

    run_event_loop(_serve_node(config, secret, engine, build, {"router"}))


# -- decode ---------------------------------------------------------------------------


def run_decode(config: ServerConfig, registry: PluginRegistry) -> None:
    secret = require_cluster_secret("decode", config.cluster_secret_file, os.environ)
    transfer = transfer_config(config)
    engine = _build_engine(config, registry, config.engine_config)
    sized = engine_config_of(engine, config.engine_config)  # the KV budget, sized if unset
    parts = DecodeNodeParts(engine=engine, scheduler_config=decode_scheduler_config(config, sized),
                            codecs=registry.entries.get("kv_codec", {}),
                            transfer_timeout_s=transfer.transfer_timeout_s,
                            kv_budget_bytes=sized.kv_memory_bytes,
                            model_bytes=engine_model_bytes(engine))
    build = lambda: DecodeNode(parts, config.effective_node_id)  # noqa: E731
    run_event_loop(_serve_node(config, secret, engine, build, {"router", "prefill"}))


# -- shared serving loop --------------------------------------------------------------


def run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` on uvloop when installed (uvicorn's extra; the router runs on it too).

    Its wakeups from the engine thread and its socket writes cost a fraction of asyncio's.
    """
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)


def in_flight(node: PrefillNode | DecodeNode) -> int:
    """Requests the node still works on: what a drain waits for."""
    if isinstance(node, PrefillNode):
        return len(node.jobs)
    return len(node.live) + len(node.claims) + len(node.local) + len(node.ready)


async def _serve_node(config: ServerConfig, secret: ClusterSecret, engine: Engine,
                      build: Callable[[], Any], accept_roles: set[str]) -> None:
    with StopSignals().installed() as signals:
        await _serve_until_drained(config, secret, engine, build, accept_roles, signals)


async def _drained(node: PrefillNode | DecodeNode, settings: NodeSettings,
                   signals: StopSignals) -> None:
    """Wait for the first signal, then drain: no new work, in-flight finishes (bounded)."""
    await signals.drain.wait()
    node.drain.begin()
    left = await wait_drained(lambda: in_flight(node), settings.drain_timeout_s,
                              signals.stop_now)
    if left:
        logger.warning("node %s: %d request(s) still in flight after the drain; cancelling "
                       "them", node.node_id, left)


def node_profile(config: ServerConfig, engine: Engine) -> NodeProfile:
    """What this node's KV is (engine fingerprint, ``kv_bits``) and its tokenizer/template."""
    engine_config = config.engine_config
    kv = KVProfile.from_fingerprint(engine.info.fingerprint, engine_config.kv_bits,
                                    engine_config.kv_group_size)
    return NodeProfile(kv, tokenizer_digest(config.model), chat_template_digest(config.model))


def _announce(config: ServerConfig, engine: Engine) -> dict[str, str]:
    """What every peer reads in this node's verdict: the model it serves (when known), the
    handoff serde versions it takes, and its profile (docs/compatibility.md)."""
    model = model_fingerprint(config.model)
    return {**({"model": model} if model else {}), KV_SERDE_ANNOUNCE: announce_serde_versions(),
            **node_profile(config, engine).to_announce()}


async def _serve_until_drained(config: ServerConfig, secret: ClusterSecret, engine: Engine,
                               build: Callable[[], Any], accept_roles: set[str],
                               signals: StopSignals) -> None:
    # start() may warm up for seconds: keep the loop free (signals) meanwhile.
    await asyncio.to_thread(engine.start)
    node = build()
    freeze_startup_heap()  # the model, tokenizer and imports: never scanned again
    watchdog = LoopWatchdog(asyncio.get_running_loop()).start()  # logs where a stall is
    settings = node_settings(config)
    on_link = _with_telemetry(node.serve, node.telemetry, settings.telemetry_interval_s,
                              node.drain)
    links = await serve_links(config.serving_bind, secret, config.role, node.node_id,
                              accept_roles, on_link, max_links=settings.max_links,
                              config=link_config(config.role, config.bulk_lanes,
                                                 config.ingest_nice),
                              announce=_announce(config, engine))
    ops = await OpsServer.start(config.host, config.port, OpsRoutes(
        node.health, node.metrics.render, ready=lambda: not node.drain.draining))
    # None unless --advertise mdns
    advert = await advertise(config, node.node_id, node_profile(config, engine))
    housekeeping = asyncio.create_task(node.housekeeping(), name="housekeeping")
    logger.info("%s node %s: links on %s, health/metrics on http://%s:%d", config.role,
                node.node_id, links.address, config.host, config.port)
    try:
        await _drained(node, settings, signals)
    finally:
        logger.info("%s node %s shutting down", config.role, node.node_id)
        housekeeping.cancel()
        if advert is not None:
            await advert.close()  # routers drain this node now, not when the records expire
        await ops.close()
        await node.close()
        await links.close()
        await asyncio.to_thread(engine.close)
        watchdog.stop()


def _with_telemetry(serve: Callable[[Link], Awaitable[None]], snapshot: Callable[[], Any],
                    interval_s: float, drain: NodeDrain) -> Callable[[Link], Awaitable[None]]:
    """Router links get telemetry, and hear when the node drains."""

    async def on_link(link: Link) -> None:
        telemetry = None
        if link.peer_role == "router":
            telemetry = asyncio.create_task(send_telemetry(link, snapshot, interval_s))
            drain.add_router(link)
        try:
            await serve(link)
        finally:
            drain.remove_router(link)
            if telemetry is not None:
                telemetry.cancel()

    return on_link
