"""The built-in sources on their own: peers file, DNS (a local server), Kubernetes events."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest
from kubernetes.client import (
    V1Container,
    V1ContainerPort,
    V1ObjectMeta,
    V1Pod,
    V1PodCondition,
    V1PodSpec,
    V1PodStatus,
)

from mlxcel_plugin.config import ServerConfig
from mlxcel_plugin.discovery_api import DiscoveryConfig, Member, model_fingerprint
from mlxcel_plugin.errors import ConfigError
from router_plugin.discovery.dns import DnsSource
from router_plugin.discovery.kubernetes import SYNC, KubernetesSource, apply_event, pod_member
from router_plugin.discovery.peers_file import PeersFileSource, parse_peers_file
from router_plugin.discovery.wiring import source_names
from tests.router_plugin.discovery.local_dns import LocalDns

FAST = DiscoveryConfig(interval_s=0.05)


def keys(snapshot):
    return sorted(member.key for member in snapshot)


# --- peers file -----------------------------------------------------------------------


def test_peers_file_entries_are_addresses_or_tables_with_a_fingerprint():
    members = parse_peers_file('prefill = ["a:1"]\n'
                               'decode = ["b:2", { address = "c:3", fingerprint = "ff" }]\n')
    assert members == {Member("prefill", "a:1", None, "file"),
                       Member("decode", "b:2", None, "file"),
                       Member("decode", "c:3", "ff", "file")}


@pytest.mark.parametrize("text", ['decode = "b:2"', 'decode = ["nope"]', "router = []", "x ="])
def test_a_bad_peers_file_is_a_config_error(text):
    with pytest.raises(ConfigError):
        parse_peers_file(text)


def test_the_peers_file_is_followed_and_a_broken_version_keeps_the_last_good_one(tmp_path):
    path = tmp_path / "peers.toml"
    path.write_text('decode = ["b:2"]\n')
    source = PeersFileSource(ServerConfig(peers_file=str(path)), FAST)

    async def scenario():
        watch = source.watch()
        assert keys(await anext(watch)) == [("decode", "b:2")]
        path.write_text('decode = ["b:2", "c:3"]\n')
        assert keys(await anext(watch)) == [("decode", "b:2"), ("decode", "c:3")]
        path.write_text('decode = ["b:2", \n')  # half-written: ignored
        path.write_text('decode = ["c:3"]\nprefill = ["a:1"]\n')
        assert keys(await anext(watch)) == [("decode", "c:3"), ("prefill", "a:1")]
        await watch.aclose()

    asyncio.run(scenario())


def test_sighup_rereads_the_peers_file_at_once(tmp_path):
    path = tmp_path / "peers.toml"
    path.write_text('decode = ["b:2"]\n')
    slow = DiscoveryConfig(interval_s=3600)  # only the signal can make it look again
    source = PeersFileSource(ServerConfig(peers_file=str(path)), slow)

    async def scenario():
        watch = source.watch()
        await anext(watch)
        stat = path.stat()
        path.write_text('decode = ["c:3"]\n')
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same mtime...
        os.kill(os.getpid(), signal.SIGHUP)
        snapshot = await asyncio.wait_for(anext(watch), 10)
        assert keys(snapshot) == [("decode", "c:3")]
        await watch.aclose()

    asyncio.run(scenario())


# --- dns ------------------------------------------------------------------------------


def test_dns_entries_follow_every_a_and_aaaa_record_and_survive_a_dead_server():
    with LocalDns() as dns:
        dns.set("decode.test", "127.0.0.2", "127.0.0.3", "::1")
        config = ServerConfig(prefill_peers=("127.0.0.1:1",),
                              decode_peers=("dns:decode.test:9000",))
        source = DnsSource(config, DiscoveryConfig(interval_s=0.05,
                                                   nameservers=(dns.nameserver,)))

        async def scenario():
            watch = source.watch()
            assert keys(await anext(watch)) == [("decode", "127.0.0.2:9000"),
                                                ("decode", "127.0.0.3:9000"),
                                                ("decode", "[::1]:9000")]
            dns.set("decode.test", "127.0.0.3")
            assert keys(await anext(watch)) == [("decode", "127.0.0.3:9000")]
            dns.server.stop()  # lookups now time out: the last answer stands
            lookup_failed = asyncio.create_task(anext(watch))
            await asyncio.sleep(3 * 2.0)
            assert not lookup_failed.done()
            lookup_failed.cancel()

        asyncio.run(scenario())


def test_a_name_with_no_records_holds_no_node():
    with LocalDns() as dns:
        config = ServerConfig(decode_peers=("dns:missing.test:9000",))
        source = DnsSource(config, DiscoveryConfig(nameservers=(dns.nameserver,)))

        async def scenario():
            watch = source.watch()
            assert await anext(watch) == frozenset()
            await watch.aclose()

        asyncio.run(scenario())


# --- kubernetes -----------------------------------------------------------------------


def pod(name: str, role: str | None = "decode", ip: str | None = "10.1.0.5",
        ready: bool = True, fingerprint: str | None = None) -> V1Pod:
    labels = {"app.kubernetes.io/part-of": "mlxcel"}
    if role:
        labels["disaggregatedset.x-k8s.io/role"] = role
    annotations = {"mlxcel.io/model-fingerprint": fingerprint} if fingerprint else None
    container = V1Container(name="node", ports=[V1ContainerPort(container_port=9000,
                                                                name="link")])
    status = V1PodStatus(pod_ip=ip, conditions=[
        V1PodCondition(type="Ready", status="True" if ready else "False")])
    return V1Pod(metadata=V1ObjectMeta(name=name, labels=labels, annotations=annotations),
                 spec=V1PodSpec(containers=[container]), status=status)


def test_a_pod_is_a_node_when_ready_with_an_ip_a_role_and_a_link_port():
    config = DiscoveryConfig()
    assert pod_member(pod("d0", fingerprint="ff"), config) == Member(
        "decode", "10.1.0.5:9000", "ff", "kubernetes")
    assert pod_member(pod("d0", ready=False), config) is None
    assert pod_member(pod("d0", ip=None), config) is None
    assert pod_member(pod("d0", role=None), config) is None
    assert pod_member(pod("d0", role="router"), config) is None


def test_watch_events_translate_into_membership():
    members: dict[str, Member] = {}
    config = DiscoveryConfig()
    events = [
        ({"type": SYNC, "object": [pod("d0"), pod("p0", role="prefill", ip="10.1.0.6")]}, True),
        ({"type": "ADDED", "object": pod("d1", ip="10.1.0.7", ready=False)}, False),
        ({"type": "MODIFIED", "object": pod("d1", ip="10.1.0.7")}, True),  # became ready
        ({"type": "BOOKMARK", "object": pod("d1")}, False),
        ({"type": "MODIFIED", "object": pod("d0", ready=False)}, True),  # terminating
        ({"type": "DELETED", "object": pod("p0", role="prefill", ip="10.1.0.6")}, True),
    ]
    for event, changed in events:
        assert apply_event(members, event, config) is changed, event["type"]
    assert sorted(members) == ["d1"]
    assert apply_event(members, {"type": SYNC, "object": []}, config)  # a re-list resets
    assert members == {}


def test_the_kubernetes_source_yields_snapshots_from_the_watch_thread():
    def stream(stop: threading.Event):
        yield {"type": SYNC, "object": [pod("d0")]}
        yield {"type": "ADDED", "object": pod("p0", role="prefill", ip="10.1.0.6")}
        stop.wait()

    source = KubernetesSource(ServerConfig(), DiscoveryConfig(), stream=stream)

    async def scenario():
        watch = source.watch()
        assert await anext(watch) == frozenset()
        assert keys(await anext(watch)) == [("decode", "10.1.0.5:9000")]
        assert keys(await anext(watch)) == [("decode", "10.1.0.5:9000"),
                                            ("prefill", "10.1.0.6:9000")]
        await watch.aclose()

    asyncio.run(scenario())


# --- which sources run, and the fingerprint -------------------------------------------


def test_source_names_follow_the_config():
    assert source_names(ServerConfig(decode_peers=("a:1",))) == ["static"]
    config = ServerConfig(peers_file="p.toml", decode_peers=("dns:d.svc:9000",),
                          discovery="mdns, static,kubernetes")
    assert source_names(config) == ["static", "file", "dns", "mdns", "kubernetes"]


def test_the_fingerprint_is_a_digest_of_the_checkpoint_config(tmp_path):
    (tmp_path / "config.json").write_text('{"b": 1, "a": [2]}')
    same = tmp_path / "copy"
    same.mkdir()
    (same / "config.json").write_text('{"a": [2],\n "b": 1}')
    assert model_fingerprint(tmp_path) == model_fingerprint(same)
    (same / "config.json").write_text('{"a": [2], "b": 2}')
    assert model_fingerprint(tmp_path) != model_fingerprint(same)
    assert model_fingerprint(tmp_path / "nothing") is None
