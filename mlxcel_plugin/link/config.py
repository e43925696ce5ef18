"""A link's tunables and the WebSocket close codes it closes with."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from mlxcel_plugin.errors import ConfigError
from mlxcel_plugin.link.bulk import DEFAULT_CHUNK_BYTES
from mlxcel_plugin.link.protocol.handshake import MAX_BULK_LANES
from mlxcel_plugin.link.protocol.records import DEFAULT_MAX_RECORD_BYTES, TAG_BYTES

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY_VIOLATION = 1008
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TRY_AGAIN_LATER = 1013

BULK_LANES_ENV = "MLXCEL_BULK_LANES"
MAX_DEFAULT_BULK_LANES = 4


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the OS keeps one (a node
    pinned with ``taskset``, or in a container's cpuset), else the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def default_bulk_lanes(environ: os._Environ | dict[str, str] = os.environ) -> int:
    """Bulk lanes per KV link: ``MLXCEL_BULK_LANES`` if set, else one per usable core up to 4.

    Each lane is a TCP stream with its own sealing/opening threads, so lanes beyond the
    cores that run them add sockets, not speed, and cost CPU: on a decode node pinned to
    one core, two lanes' readers side by side took 10-17% more CPU than one lane (256 MiB
    to 64 MiB handoffs, 8B-shaped), and a bare AES-GCM receiver ~5% more.
    """
    raw = environ.get(BULK_LANES_ENV, "").strip()
    if not raw:
        return max(1, min(MAX_DEFAULT_BULK_LANES, usable_cores()))
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_BULK_LANES:
        raise ConfigError(f"{BULK_LANES_ENV}={raw!r}: expected a whole number of lanes "
                          f"from 1 to {MAX_BULK_LANES}")
    return int(raw)


def bulk_lanes_for(setting: int = 0) -> int:
    """The lanes a node's KV links use: ``setting`` (``--bulk-lanes``, ``[server]
    bulk_lanes``, ``MLXCEL_BULK_LANES``: config.ServerConfig) when set, else one per core up
    to 4 (``default_bulk_lanes``)."""
    if setting == 0:
        return default_bulk_lanes()
    if not 1 <= setting <= MAX_BULK_LANES:
        raise ConfigError(f"bulk_lanes = {setting}: expected a whole number of lanes "
                          f"from 1 to {MAX_BULK_LANES} (0: one per core, up to "
                          f"{MAX_DEFAULT_BULK_LANES})")
    return setting


@dataclass(frozen=True)
class LinkConfig:
    """Tunables of a link; defaults suit a LAN cluster."""

    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    max_frame_bytes: int = 1024 * 1024 * 1024  # one frame, reassembled; the KV layer splits above
    handshake_timeout_s: float = 5.0
    send_queue_bytes: int = 32 * 1024 * 1024
    recv_queue_frames: int = 16
    ws_max_queue: int = 4  # WebSocket messages buffered before TCP pushes back
    ping_interval_s: float | None = 20.0
    ping_timeout_s: float | None = 20.0
    close_timeout_s: float = 5.0
    bulk: bool = True
    bulk_threshold_bytes: int = 256 * 1024  # bodies at least this big use the bulk channel
    bulk_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    bulk_io_timeout_s: float = 60.0
    # Bulk lanes (parallel TCP streams) this end asks for when it dials; the peer grants
    # at most its own ``bulk_max_lanes`` (a peer granting more than asked is refused:
    # BulkLanesRefused). 1 = one stream, as with peers that predate lanes.
    bulk_lanes: int = 1
    # The most lanes this end grants a dialing peer (the rest of its ask is not granted).
    bulk_max_lanes: int = field(default_factory=default_bulk_lanes)
    # Linux: niceness of the thread that receives and decrypts bulk bodies. A decode
    # node raises it so KV ingestion yields the core to the running decode batch.
    bulk_reader_nice: int = 0

    def __post_init__(self) -> None:
        for name in ("bulk_lanes", "bulk_max_lanes"):
            if not 1 <= getattr(self, name) <= MAX_BULK_LANES:
                raise ConfigError(f"LinkConfig.{name} must be 1..{MAX_BULK_LANES}")

    @property
    def ws_max_size(self) -> int:
        return self.max_record_bytes + TAG_BYTES
