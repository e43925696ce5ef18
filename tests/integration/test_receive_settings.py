"""``--bulk-lanes`` / ``[server] bulk_lanes`` / ``MLXCEL_BULK_LANES``, ``--ingest-nice`` /
``[server] ingest_nice`` / ``MLXCEL_INGEST_NICE`` and ``--receive-pool-bytes`` / ``[engine]
receive_pool_bytes``: where each comes from, what a bad value says, and a real decode node
granting the lanes and reading KV bodies at the niceness it was given."""

from __future__ import annotations

import asyncio
import os
import sys
import time
import urllib.request

import pytest

from mlxcel_plugin.config import build_config
from mlxcel_plugin.errors import ConfigError
from mlxcel_plugin.link import LinkConfig, dial_link, generate_secret_file, load_cluster_secret
from mlxcel_plugin.link.protocol.frames import Frame, FrameType
from mlxcel_plugin.local_cluster import LOOPBACK, free_port, start_node
from mlxcel_plugin.nodes.roles import kv_link_config, link_config


def prometheus_value(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return float(line.split()[1])


def test_bulk_lanes_flag_beats_toml_beats_env(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[server]\nbulk_lanes = 3\n")
    env = {"MLXCEL_BULK_LANES": "2"}
    assert build_config({}, env=env).bulk_lanes == 2
    assert build_config({"distributed_config": str(toml)}, env=env).bulk_lanes == 3
    config = build_config({"distributed_config": str(toml), "bulk_lanes": 5}, env=env)
    assert config.bulk_lanes == 5
    assert kv_link_config(config.bulk_lanes).bulk_lanes == 5  # what a prefill node asks
    assert link_config("decode", config.bulk_lanes).bulk_max_lanes == 5  # what a node grants


def test_the_configs_lane_bound_is_the_handshakes():
    from mlxcel_plugin import config
    from mlxcel_plugin.link.protocol import handshake

    assert config.MAX_BULK_LANES == handshake.MAX_BULK_LANES


def test_unset_bulk_lanes_is_one_per_core_up_to_four():
    assert build_config({}, env={}).bulk_lanes == 0
    assert kv_link_config(0).bulk_lanes == LinkConfig().bulk_max_lanes >= 1


@pytest.mark.parametrize("lanes", [17, -1])
def test_bulk_lanes_out_of_range_is_a_config_error(lanes):
    with pytest.raises(ConfigError, match="bulk_lanes"):
        build_config({"bulk_lanes": lanes}, env={})


def test_ingest_nice_flag_beats_toml_beats_env(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[server]\ningest_nice = 9\n")
    env = {"MLXCEL_INGEST_NICE": "4"}
    assert build_config({}, env={}).ingest_nice == 15
    assert build_config({}, env=env).ingest_nice == 4
    assert build_config({"distributed_config": str(toml)}, env=env).ingest_nice == 9
    config = build_config({"distributed_config": str(toml), "ingest_nice": 0}, env=env)
    assert config.ingest_nice == 0
    # A decode node reads KV bodies at that niceness; other roles at their own.
    assert link_config("decode", 0, 9).bulk_reader_nice == 9
    assert link_config("prefill", 0, 9).bulk_reader_nice == 0


@pytest.mark.parametrize("nice", [20, -1])
def test_ingest_nice_out_of_range_is_a_config_error(nice):
    with pytest.raises(ConfigError, match="ingest_nice"):
        build_config({"ingest_nice": nice}, env={})


def test_receive_pool_flag_beats_the_engine_section(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[engine]\nreceive_pool_bytes = 1048576\n")
    config = build_config({"distributed_config": str(toml)}, env={})
    assert config.engine_config.receive_pool_bytes == 1 << 20
    config = build_config({"distributed_config": str(toml), "receive_pool_bytes": 2 << 20},
                          env={})
    assert config.engine_config.receive_pool_bytes == 2 << 20
    assert build_config({}, env={}).engine_config.receive_pool_bytes == 0  # auto
    with pytest.raises(ConfigError, match="receive_pool_bytes"):
        build_config({"receive_pool_bytes": -1}, env={})


@pytest.mark.timeout(120)
def test_a_decode_node_grants_the_lanes_its_flag_allows(tmp_path):
    """A real decode node started with ``--bulk-lanes 3 --ingest-nice 12``: a prefill peer
    asking for 4 lanes over a real link gets 3, and the node reads a bulk body on a thread at
    nice 12 (Linux)."""
    secret_path = tmp_path / "cluster.secret"
    generate_secret_file(secret_path)
    bind = f"{LOOPBACK}:{free_port()}"
    node = start_node("decode", tmp_path, ["--engine", "fake", "--model", str(tmp_path),
                                           "--cluster-secret-file", str(secret_path),
                                           "--bulk-lanes", "3", "--ingest-nice", "12"],
                      serving_bind=bind)
    try:
        node.wait_healthy(60)

        async def lanes_granted() -> int:
            link = await dial_link(bind, load_cluster_secret(str(secret_path), {}), "prefill",
                                   "p-lanes", config=LinkConfig(bulk_lanes=4))
            try:
                # A body the size of a KV chunk: read by one of the node's bulk readers.
                await link.send(Frame(FrameType.KV_CHUNK, {}, os.urandom(1 << 20)))
                if sys.platform.startswith("linux"):
                    assert 12 in await thread_nices_seen(node.process.pid, 12)
                return link.bulk_lanes
            finally:
                await link.close()

        assert asyncio.run(lanes_granted()) == 3
        # Its receive pool on /metrics (the fake engine receives into pooled numpy buffers).
        metrics = urllib.request.urlopen(f"{node.url}/metrics", timeout=10).read().decode()
        assert prometheus_value(metrics, "mlxcel:receive_pool_limit_bytes") >= 64 << 20
        assert prometheus_value(metrics, "mlxcel:receive_pool_warm_bytes") == 0
    finally:
        node.stop()


async def thread_nices_seen(pid: int, wanted: int, timeout_s: float = 30.0) -> set[int]:
    """The niceness of each of ``pid``'s threads, polled until one runs at ``wanted`` (or
    the timeout: the reader thread starts when the body's announcement is read)."""
    deadline = time.monotonic() + timeout_s
    while True:
        nices = set()
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:  # the thread ended meanwhile
                continue
            nices.add(int(fields[16]))  # stat's 19th field; [0] is its 3rd (state)
        if wanted in nices or time.monotonic() > deadline:
            return nices
        await asyncio.sleep(0.05)
