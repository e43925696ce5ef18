"""Link throughput vs raw loopback TCP, measured in the same run.

Sender and receiver are separate processes in every case. For each payload
size it pushes ``--total-mib`` one way and waits for the receiver's ack, and it
alternates the three paths each repeat so they share the same machine load:

* raw TCP: blocking ``sendall`` / ``recv_into`` a preallocated buffer (the ceiling)
* link: ``dial_link`` → ``serve_links``, KV_CHUNK frames (encrypted, bulk channel)
* link-ws: the same with the bulk channel off (every byte through websockets)

Usage: python loadtests/bench_link.py [--quick] [--json PATH] [--sizes 1,4,16]
                                     [--total-mib 512] [--repeats 5] [--no-ws]

``--quick``: 128 MiB per measurement, 3 repeats, no link-ws path (a few seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import time
from typing import Any

from bench_common import add_common_args, bench_result, table, write_json

from mlxcel_plugin.link import LinkConfig, dial_link, serve_links
from mlxcel_plugin.link.protocol.frames import Frame, FrameType

MIB = 1024 * 1024
SECRET = bytes(range(32))  # fixed: spawned receivers re-import this module


# ---------------------------------------------------------------- raw TCP


def _raw_receiver(port_q: mp.Queue, size: int, count: int, repeats: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port_q.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    view = memoryview(bytearray(size))
    for _ in range(repeats):
        for _ in range(count):
            got = 0
            while got < size:  # bounded by size
                n = conn.recv_into(view[got:])
                if n == 0:
                    return
                got += n
        conn.sendall(b"k")
    conn.close()


def start_raw(size: int, count: int, repeats: int) -> tuple[mp.Process, socket.socket]:
    port_q: mp.Queue = mp.Queue()
    proc = mp.Process(target=_raw_receiver, args=(port_q, size, count, repeats), daemon=True)
    proc.start()
    return proc, socket.create_connection(("127.0.0.1", port_q.get(timeout=30)))


def raw_once(conn: socket.socket, data: bytes, count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        conn.sendall(data)
    conn.recv(1)
    return len(data) * count / (time.perf_counter() - start) / MIB


# ---------------------------------------------------------------- link


def _link_receiver(port_q: mp.Queue, count: int, bulk: bool) -> None:
    async def on_link(link) -> None:
        received = 0
        async for frame in link:
            if frame.type is FrameType.KV_CHUNK:
                received += 1
                if received % count == 0:
                    await link.send(Frame(FrameType.KV_ACK, {"n": received}))

    async def main() -> None:
        server = await serve_links(
            "127.0.0.1:0",
            SECRET,
            "decode",
            "bench-decode",
            {"prefill"},
            on_link,
            config=LinkConfig(bulk=bulk),
        )
        port_q.put(server.port)
        await asyncio.sleep(3600)  # the parent terminates us

    asyncio.run(main())


def start_link_receiver(count: int, bulk: bool) -> tuple[mp.Process, int]:
    port_q: mp.Queue = mp.Queue()
    proc = mp.Process(target=_link_receiver, args=(port_q, count, bulk), daemon=True)
    proc.start()
    return proc, port_q.get(timeout=30)


async def link_once(link, data: bytes, count: int) -> float:
    start = time.perf_counter()
    for i in range(count):
        await link.send(Frame(FrameType.KV_CHUNK, {"i": i}, data))
    ack = await link.recv()
    if ack.type is not FrameType.KV_ACK:
        raise RuntimeError(f"unexpected {ack}")
    return len(data) * count / (time.perf_counter() - start) / MIB


async def measure(size: int, count: int, repeats: int, with_ws: bool) -> dict[str, list[float]]:
    """Alternate raw / link / link-ws each repeat, so all three see the same machine load."""
    raw_proc, raw_conn = start_raw(size, count, repeats)
    modes = {"link": True, "link-ws": False} if with_ws else {"link": True}
    receivers = {name: start_link_receiver(count, bulk) for name, bulk in modes.items()}
    links = {
        name: await dial_link(
            f"127.0.0.1:{port}",
            SECRET,
            "prefill",
            "bench-prefill",
            config=LinkConfig(bulk=modes[name]),
        )
        for name, (_, port) in receivers.items()
    }
    data = os.urandom(size)
    rates: dict[str, list[float]] = {"raw": [], **{name: [] for name in modes}}
    try:
        for _ in range(repeats):
            rates["raw"].append(raw_once(raw_conn, data, count))
            for name, link in links.items():
                rates[name].append(await link_once(link, data, count))
    finally:
        raw_conn.close()
        for link in links.values():
            await link.close()
        for proc, _ in receivers.values():
            proc.terminate()
        raw_proc.join(timeout=10)
    return rates


# ---------------------------------------------------------------- main

COLUMNS = ["size MiB", "raw TCP MiB/s", "link MiB/s", "link / raw", "link-ws MiB/s", "ws / raw"]


def measure_size(size_mib: int, args: argparse.Namespace) -> list[Any]:
    """One table row: medians of the repeats for one payload size."""
    size, count = size_mib * MIB, max(1, args.total_mib // size_mib)
    rates = asyncio.run(measure(size, count, args.repeats, not args.no_ws))
    raw, link = statistics.median(rates["raw"]), statistics.median(rates["link"])
    row: list[Any] = [size_mib, round(raw), round(link), round(link / raw, 2), None, None]
    if "link-ws" in rates:
        ws = statistics.median(rates["link-ws"])
        row[4:] = [round(ws), round(ws / raw, 2)]
    return row


def print_row(row: list[Any]) -> None:
    line = f"{row[0]:>4}Mi {row[1]:>10} {row[2]:>10} {row[3]:>6.2f}"
    if row[4] is not None:
        line += f" {row[4]:>10} {row[5]:>6.2f}"
    print(line, flush=True)


def result_json(rows: list[list[Any]], args: argparse.Namespace) -> dict[str, Any]:
    series = {
        "size_mib": [row[0] for row in rows],
        "raw_tcp_mib_s": [row[1] for row in rows],
        "link_mib_s": [row[2] for row in rows],
        "ratio": [row[3] for row in rows],
    }
    if not args.no_ws:
        series["link_ws_mib_s"] = [row[4] for row in rows]
    plot = {
        "x": "size_mib",
        "y": [name for name in ("raw_tcp_mib_s", "link_mib_s", "link_ws_mib_s") if name in series],
        "title": "Transfer throughput vs raw TCP (loopback, median)",
        "xlabel": "payload per frame (MiB)",
        "ylabel": "MiB/s",
        "logx": True,
    }
    title = f"Link vs raw TCP, {args.total_mib} MiB per measurement, median of {args.repeats}"
    return bench_result("link", [table(title, COLUMNS, rows)], series, plot)


def parse_args() -> argparse.Namespace:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--sizes", default="1,4,16", help="payload sizes in MiB")
    parser.add_argument("--total-mib", type=int, default=0, help="bytes per measurement (512)")
    parser.add_argument("--repeats", type=int, default=0, help="measurements per path (5)")
    parser.add_argument("--no-ws", action="store_true", help="skip the websockets-only path")
    args = parser.parse_args()
    # --quick: fewer, smaller measurements; the ws-only path is the slowest and least asked.
    args.total_mib = args.total_mib or (128 if args.quick else 512)
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.no_ws = args.no_ws or args.quick
    return args


def main() -> None:
    args = parse_args()
    print(f"{'size':>6} {'raw TCP':>10} {'link':>10} {'ratio':>6} {'link-ws':>10} {'ratio':>6}"
          "   (MiB/s, median)")  # fmt: skip
    rows = []
    for size_mib in (int(s) for s in args.sizes.split(",")):
        rows.append(measure_size(size_mib, args))
        print_row(rows[-1])
    if args.json:
        write_json(args.json, result_json(rows, args))


if __name__ == "__main__":
    mp.set_start_method("spawn")
    main()
