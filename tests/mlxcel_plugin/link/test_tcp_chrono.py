"""tcp_chrono reads the kernel's per-connection clocks (Linux TCP_INFO): time with data in
flight, and the part of it the peer's receive window held back."""

from __future__ import annotations

import socket
import sys
import time

import pytest

from mlxcel_plugin.link.tcp_chrono import TcpChrono, busiest_since, tcp_chrono

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO chrono")


def connected_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    return client, accepted


@linux_only
def test_a_receiver_that_does_not_read_holds_the_sender_back_by_its_window():
    sender, receiver = connected_pair()
    try:
        before = tcp_chrono(sender)
        assert before is not None and before.rwnd_limited_s == 0.0
        sender.setblocking(False)
        with pytest.raises(BlockingIOError):  # bounded: the buffers fill
            while True:
                sender.send(bytes(1 << 20))
        deadline = time.monotonic() + 10
        held = tcp_chrono(sender) - before
        while held.rwnd_limited_s < 0.02 and time.monotonic() < deadline:
            time.sleep(0.005)  # polls the kernel's clock, which moves in jiffies
            held = tcp_chrono(sender) - before
        assert held.rwnd_limited_s >= 0.02
        assert held.busy_s >= held.rwnd_limited_s  # in-flight time counts the held time too
        assert tcp_chrono(receiver).rwnd_limited_s == 0.0  # it sent nothing
    finally:
        sender.close()
        receiver.close()


def test_no_clock_where_there_is_no_tcp_connection():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        assert tcp_chrono(udp) is None
    closed, other = connected_pair()
    closed.close()
    other.close()
    assert tcp_chrono(closed) is None and tcp_chrono(None) is None


def test_a_window_is_its_busiest_connections_and_needs_every_one():
    then = (TcpChrono(1.0, 0.0), TcpChrono(0.0, 0.0))
    now = (TcpChrono(1.5, 0.5), TcpChrono(2.0, 0.25))  # the second busier in between
    assert busiest_since(now, then) == TcpChrono(2.0, 0.25)
    assert busiest_since((*now[:1], None), then) is None
    assert busiest_since(now, ()) is None and busiest_since((), ()) is None
