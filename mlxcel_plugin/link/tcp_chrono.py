"""How long a TCP connection kept data in flight, by the kernel's own clock (Linux TCP_INFO).

Why: a prefill node learns a link's speed from how long its handoffs take, and that time
is the link's only where the link set the pace. Since 4.10 Linux keeps, per connection,
the time it had data in flight (``tcpi_busy_time``) and the part of it the peer's receive
window held it back (``tcpi_rwnd_limited``). A connection idle for most of a handoff's
window waited for its sender (prefill, an event loop, a CPU shared with other work), not
for the network; one held by the receive window waited for the receiver
(docs/bulk-lanes.md#who-set-the-pace). Elsewhere (macOS) there is no such clock: None.
"""

from __future__ import annotations

import socket
import struct
import sys
from dataclasses import dataclass

# struct tcp_info (include/uapi/linux/tcp.h): after 8 one-byte fields, 24 u32 up to
# tcpi_total_retrans, then u64 pacing_rate, max_pacing_rate, bytes_acked, bytes_received,
# six u32 (segs_out .. data_segs_out) and u64 delivery_rate: tcpi_busy_time and
# tcpi_rwnd_limited are the u64 microsecond counts at these offsets.
_BUSY_OFFSET = 168
_CHRONO = struct.Struct("=QQ")
_INFO_BYTES = _BUSY_OFFSET + _CHRONO.size
_HAS_TCP_INFO = sys.platform.startswith("linux") and hasattr(socket, "TCP_INFO")


@dataclass(frozen=True)
class TcpChrono:
    """Seconds with data in flight, and of those, seconds the receive window held back."""

    busy_s: float = 0.0
    rwnd_limited_s: float = 0.0

    def __sub__(self, other: TcpChrono) -> TcpChrono:
        return TcpChrono(self.busy_s - other.busy_s, self.rwnd_limited_s - other.rwnd_limited_s)


def tcp_chrono(sock: socket.socket | None) -> TcpChrono | None:
    """The connection's counts now; None off Linux, on kernels without them, or once closed."""
    if not _HAS_TCP_INFO or sock is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _INFO_BYTES)
    except OSError:
        return None
    if len(info) < _INFO_BYTES:  # a kernel before 4.10 fills fewer fields
        return None
    busy_us, rwnd_us = _CHRONO.unpack_from(info, _BUSY_OFFSET)
    return TcpChrono(busy_us / 1e6, rwnd_us / 1e6)


Counts = tuple[TcpChrono | None, ...]  # one per connection, in a fixed order


def busiest_since(now: Counts, then: Counts) -> TcpChrono | None:
    """What the connection with data in flight longest did between two readings of the
    same connections. A link is busy while any of its connections is: the busiest one's
    time is a lower bound on that (a link's bodies may all take one lane), their sum an
    upper one. None without counts for every connection at both readings."""
    if not now or len(now) != len(then) or None in now or None in then:
        return None
    spans = [late - early for late, early in zip(now, then, strict=True)]  # type: ignore[operator]
    return max(spans, key=lambda span: span.busy_s)
