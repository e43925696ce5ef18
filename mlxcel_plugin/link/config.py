"""A link's tunables and the WebSocket close codes it closes with."""

from __future__ import annotations

from dataclasses import dataclass

from mlxcel_plugin.link.bulk import DEFAULT_CHUNK_BYTES
from mlxcel_plugin.link.protocol.records import DEFAULT_MAX_RECORD_BYTES, TAG_BYTES

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY_VIOLATION = 1008
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TRY_AGAIN_LATER = 1013


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
    # Linux: niceness of the thread that receives and decrypts bulk bodies. A decode
    # node raises it so KV ingestion yields the core to the running decode batch.
    bulk_reader_nice: int = 0

    @property
    def ws_max_size(self) -> int:
        return self.max_record_bytes + TAG_BYTES
