"""pace_of: who set a handoff window's pace, from the decode node's readers and the link's
connections' kernel clocks."""

from __future__ import annotations

import pytest

from mlxcel_plugin.link.tcp_chrono import TcpChrono
from mlxcel_plugin.transfer.pacing import (
    LINK,
    LINK_BUSY_SHARE,
    RECEIVER,
    RECEIVER_PACED_SHARE,
    RWND_LIMITED_SHARE,
    SENDER,
    LinkSample,
    pace_of,
)


@pytest.mark.parametrize(("busy_s", "rwnd_s", "readers", "expected"), [
    (1.0, 0.0, 0.1, LINK),  # in flight throughout, readers asleep in recv: the link
    (0.3, 0.0, 0.5, SENDER),  # idle for most of the window: the link waited for bytes
    (1.0, 0.6, 0.5, RECEIVER),  # the receive window held it back
    (1.0, 0.0, RECEIVER_PACED_SHARE, RECEIVER),  # the readers were busy throughout
    (0.3, 0.0, 0.95, RECEIVER),  # both ends slow: the readers' word first
    (LINK_BUSY_SHARE, RWND_LIMITED_SHARE - 0.01, None, LINK),  # at the bounds
])
def test_who_paced_a_one_second_window(busy_s, rwnd_s, readers, expected):
    assert pace_of(1.0, TcpChrono(busy_s, rwnd_s), readers) == expected
    assert LinkSample(8 << 20, 1.0, TcpChrono(busy_s, rwnd_s)).paced_by(readers) == expected


def test_without_a_kernel_clock_the_time_is_the_links_unless_the_readers_were_busy():
    assert pace_of(1.0, None, None) == LINK
    assert pace_of(1.0, None, 0.2) == LINK
    assert pace_of(1.0, None, 0.9) == RECEIVER
    assert pace_of(0.0, TcpChrono(0.0, 0.0), None) == LINK  # no window to compare with
