"""NetnsTopology: what it builds, that it removes all of it (also on failure), tbf sizing."""

from __future__ import annotations

import subprocess

import pytest

from mlxcel_plugin.testing import netns


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


def test_tbf_bucket_holds_a_gso_packet_and_grows_with_the_rate():
    assert netns.tbf_args(1e9) == ["tbf", "rate", "1000000000bit", "burst", "500000",
                                   "latency", "50ms"]
    slow = netns.tbf_args(10e6)
    assert slow[slow.index("burst") + 1] == str(netns.MIN_BURST_BYTES)


def test_a_topology_is_removed_whole_even_when_its_body_fails():
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    before = namespaces()
    with pytest.raises(RuntimeError), netns.NetnsTopology(("a", "b"), rate_bits_per_s=1e9) as net:
        made = {host.namespace for host in net.hosts.values()} | {net.hub}
        assert made <= namespaces() and f"mx{net.tag}r" in links()
        assert net.address("a") != net.address("b")
        qdisc = subprocess.run(net.exec_argv("a", ["tc", "qdisc", "show", "dev", "eth0"]),
                               capture_output=True, text=True, check=True).stdout
        assert "tbf" in qdisc and "rate 1Gbit" in qdisc
        raise RuntimeError("the test body failed")
    assert namespaces() == before
    assert f"mx{net.tag}r" not in links()


def test_two_topologies_at_once_get_their_own_names_and_subnets():
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    with netns.NetnsTopology(("a",)) as first, netns.NetnsTopology(("a",)) as second:
        assert first.hosts["a"].namespace != second.hosts["a"].namespace
        assert first.root_address.split(".")[2] != second.root_address.split(".")[2]
