"""free_port: picks outside the kernel's ephemeral range, so nothing else grabs it first."""

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
