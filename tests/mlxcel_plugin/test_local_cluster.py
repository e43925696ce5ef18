"""free_port: outside the kernel's ephemeral range, and never the same port twice."""

import socket

from mlxcel_plugin import local_cluster
from mlxcel_plugin.local_cluster import LOOPBACK, free_port


def test_the_port_is_below_the_ephemeral_range_and_bindable():
    port = free_port()
    assert port in local_cluster._PICK_PORTS
    with socket.socket() as sock:
        sock.bind((LOOPBACK, port))


def test_a_busy_range_falls_back_to_a_kernel_pick(monkeypatch):
    with socket.socket() as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(local_cluster, "_PICK_PORTS", range(busy, busy + 1))
        port = free_port()
        assert port != busy and port > 0


def test_a_port_is_never_handed_out_twice(monkeypatch):
    """Two nodes of one cluster asked for ports before either bound: never the same one."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # the whole range, not a share
    monkeypatch.setattr(local_cluster, "_PICK_PORTS", range(21000, 21004))
    monkeypatch.setattr(local_cluster, "_handed_out", set())
    monkeypatch.setattr(local_cluster, "_pick_ports", lambda: local_cluster._PICK_PORTS)
    # Whether a real port is bindable depends on what else runs here (a node of another test
    # may hold one): 21001 stands for a port someone holds, the others for free ones.
    monkeypatch.setattr(local_cluster, "_bindable", lambda port: port != 21001)
    ports = [free_port() for _ in range(3)]
    assert sorted(ports) == [21000, 21002, 21003]
    fallback = free_port()  # the range is used up: the kernel's pick, also new
    assert fallback not in ports and fallback != 21001


def test_the_pick_avoids_the_kernels_ephemeral_range(monkeypatch, tmp_path):
    proc = tmp_path / "ip_local_port_range"
    real_path = local_cluster.Path

    def fake_path(name):
        return proc if name == "/proc/sys/net/ipv4/ip_local_port_range" else real_path(name)

    monkeypatch.setattr(local_cluster, "Path", fake_path)
    proc.write_text("1024\t65000\n")
    assert local_cluster._pick_ports() == range(65001, 65536)
    proc.write_text("32768\t60999\n")
    assert local_cluster._pick_ports() == local_cluster._PICK_PORTS
    proc.write_text("25000\t60999\n")
    assert local_cluster._pick_ports() == range(20000, 25000)


def test_xdist_workers_pick_from_disjoint_shares(monkeypatch):
    """Two workers' nodes start side by side: neither may be handed a port the other can be."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    shares = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        shares.append(set(local_cluster._worker_share(range(21000, 21010))))
    assert shares == [{21000, 21002, 21004, 21006, 21008}, {21001, 21003, 21005, 21007, 21009}]
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    assert local_cluster._worker_share(range(21000, 21001)) == range(21000, 21001)
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert local_cluster._worker_share(range(21000, 21010)) == range(21000, 21010)
