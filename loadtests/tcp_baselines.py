"""The floors a KV handoff is judged against: the same bytes over raw TCP, and over bare
AES-256-GCM TCP (``encrypt_into`` a reused record buffer, ``recv_into`` a reused buffer,
``decrypt_into`` warm destination memory), each over ``lanes`` TCP connections of
``record_bytes`` records, as the product's bulk channel is configured.

Run as two processes (so each side's CPU time is its own), e.g. inside two network
namespaces::

    python loadtests/tcp_baselines.py sink HOST PORT BYTES --lanes 2 --record 1048576 --aes
    python loadtests/tcp_baselines.py send HOST PORT BYTES --lanes 2 --record 1048576 --aes

The sink prints ``ready`` once listening, then one JSON line ``{"bytes", "cpu_s"}``;
the sender one JSON line ``{"seconds", "cpu_s"}`` (from its first byte to the sink's
one-byte ack). Both touch their whole buffer first, so no page fault is timed: the
baseline is the floor, warm memory and one AEAD pass per side.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from mlxcel_plugin.cache_lines import from_cache_line, padded_elements

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import process_cpu_s  # noqa: E402

TAG_BYTES = 16
KEY = bytes(range(32))  # a baseline's key: what it costs matters, not what it hides
AAD = b"mlxcel-bench-baseline"
LANE_HEADER = struct.Struct("!I")


def lane_records(size: int, record: int, lanes: int, lane: int) -> list[tuple[int, int]]:
    """(offset, length) of the records lane ``lane`` carries: every ``lanes``-th one."""
    offsets = range(lane * record, size, lanes * record)
    return [(offset, min(record, size - offset)) for offset in offsets]


def nonce(lane: int, index: int) -> bytes:
    return LANE_HEADER.pack(lane) + struct.pack("!Q", index)


def warm(size: int) -> memoryview:
    """``size`` bytes, every page written once (faulted in before anything is timed),
    starting on a cache line as the product's receive buffers do (decrypting into memory
    off one costs ~12% more: mlxcel_plugin/cache_lines.py)."""
    raw = np.full(padded_elements(size, 1), 1, dtype=np.uint8)
    return memoryview(from_cache_line(raw, size)).cast("B")


def recv_exactly(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):  # bounded: each pass reads >= 1 byte or raises
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("sender closed mid-record")
        got += n


# ---------------------------------------------------------------- sending


def send_lane(conn: socket.socket, source: memoryview, records: list[tuple[int, int]],
              lane: int, aes: AESGCM | None) -> None:
    sealed = memoryview(bytearray(max((n for _, n in records), default=0) + TAG_BYTES))
    for index, (offset, length) in enumerate(records):
        plain = source[offset:offset + length]
        if aes is None:
            conn.sendall(plain)
            continue
        aes.encrypt_into(nonce(lane, index), plain, AAD, sealed[:length + TAG_BYTES])
        conn.sendall(sealed[:length + TAG_BYTES])


def send(host: str, port: int, size: int, lanes: int, record: int, use_aes: bool) -> dict:
    source = warm(size)
    aes = AESGCM(KEY) if use_aes else None
    conns = [socket.create_connection((host, port)) for _ in range(lanes)]
    for lane, conn in enumerate(conns):
        conn.sendall(LANE_HEADER.pack(lane))
    start, cpu = time.perf_counter(), process_cpu_s()
    threads = [threading.Thread(target=send_lane, args=(conn, source,
                                                          lane_records(size, record, lanes, lane),
                                                          lane, aes))
               for lane, conn in enumerate(conns)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    conns[0].recv(1)  # the sink's ack: every byte landed
    seconds, cpu_s = time.perf_counter() - start, process_cpu_s() - cpu
    for conn in conns:
        conn.close()
    return {"seconds": seconds, "cpu_s": cpu_s}


# ---------------------------------------------------------------- receiving


def sink_lane(conn: socket.socket, dest: memoryview, records: list[tuple[int, int]],
              lane: int, aes: AESGCM | None) -> None:
    sealed = memoryview(bytearray(max((n for _, n in records), default=0) + TAG_BYTES))
    for index, (offset, length) in enumerate(records):
        if aes is None:
            recv_exactly(conn, dest[offset:offset + length])
            continue
        recv_exactly(conn, sealed[:length + TAG_BYTES])
        aes.decrypt_into(nonce(lane, index), sealed[:length + TAG_BYTES], AAD,
                         dest[offset:offset + length])


def sink(host: str, port: int, size: int, lanes: int, record: int, use_aes: bool) -> dict:
    dest = warm(size)
    aes = AESGCM(KEY) if use_aes else None
    with socket.create_server((host, port), backlog=lanes) as server:
        print("ready", flush=True)
        conns: dict[int, socket.socket] = {}
        while len(conns) < lanes:
            conn, _ = server.accept()
            header = memoryview(bytearray(LANE_HEADER.size))
            recv_exactly(conn, header)
            conns[LANE_HEADER.unpack(header)[0]] = conn
        cpu = process_cpu_s()
        threads = [threading.Thread(target=sink_lane,
                                    args=(conn, dest, lane_records(size, record, lanes, lane),
                                          lane, aes))
                   for lane, conn in conns.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        cpu_s = process_cpu_s() - cpu
        conns[0].sendall(b"k")
        for conn in conns.values():
            conn.close()
    return {"bytes": size, "cpu_s": cpu_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("side", choices=("send", "sink"))
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("bytes", type=int)
    parser.add_argument("--lanes", type=int, default=1)
    parser.add_argument("--record", type=int, default=1 << 20)
    parser.add_argument("--aes", action="store_true", help="seal every record (AES-256-GCM)")
    args = parser.parse_args()
    run = send if args.side == "send" else sink
    result = run(args.host, args.port, args.bytes, args.lanes, args.record, args.aes)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
