"""The link's bulk lanes alone: one handoff's worth of bytes over a real link, per lane count
and record size, to choose the defaults by measurement.

The receiver is a child process serving one link whose body sink is a warm buffer (the
KV receiver's case); the sender (this process) sends ``--gib`` GiB as KV_CHUNK
frames (the KV path's frame size) and waits for the receiver's one-frame ack. Reported:
GiB/s and CPU-s per GiB on each side (each process's own rusage over the transfer). With
``--pin`` on >= 2 cores the sender runs on core 0 and the receiver on core 1.

    python loadtests/bench_bulk_lanes.py [--gib 1] [--lanes 1,2,4] [--records 256k,1m,4m]
        [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlxcel_plugin.link import LinkConfig, dial_link, serve_links  # noqa: E402
from mlxcel_plugin.link.protocol.frames import Frame, FrameType  # noqa: E402
from mlxcel_plugin.nodes.kv_wire import FRAME_CHUNK_BYTES  # noqa: E402

SECRET = bytes(range(32))
FRAME_BYTES = FRAME_CHUNK_BYTES  # what a KV link joins chunks into
GIB = 1 << 30


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def parse_bytes(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1 << 10, "m": 1 << 20}.get(text[-1:], 1)
    return int(float(text.rstrip("km")) * scale)


# ---------------------------------------------------------------- receiver (child)


async def receive(lanes: int, record: int, total: int) -> None:
    warm = bytearray(FRAME_BYTES)
    done = asyncio.Event()
    stats: dict[str, float] = {}

    async def on_link(link):
        link.set_body_sink(lambda _t, _h, n: memoryview(warm)[:n])
        got = 0
        async for frame in link:  # until the whole handoff is in
            if got == 0:
                stats["cpu0"] = cpu_s()
            got += len(frame.body)
            if got >= total:
                stats["cpu"] = cpu_s() - stats["cpu0"]
                await link.send(Frame(FrameType.KV_ACK, {"cpu_s": stats["cpu"]}, b""))
                await link.drain()
                done.set()
                return

    config = LinkConfig(bulk_max_lanes=lanes, bulk_chunk_bytes=record)
    server = await serve_links("127.0.0.1:0", SECRET, "decode", "lanes-sink", {"prefill"},
                               on_link, config=config)
    print(json.dumps({"port": server.port}), flush=True)
    await done.wait()
    await server.close()


# ---------------------------------------------------------------- sender


async def send(port: int, lanes: int, total: int, queue_bytes: int) -> dict[str, float]:
    config = LinkConfig(bulk_lanes=lanes, send_queue_bytes=queue_bytes)
    link = await dial_link(f"127.0.0.1:{port}", SECRET, "prefill", "lanes-source",
                           config=config)
    assert link.bulk_lanes == lanes, (link.bulk_lanes, lanes)
    body = memoryview(os.urandom(FRAME_BYTES))  # warm, like MLX memory already evaluated
    cpu0, t0 = cpu_s(), time.perf_counter()
    for i in range(total // FRAME_BYTES):
        await link.send(Frame(FrameType.KV_CHUNK, {"i": i}, body))
    ack = await link.recv()
    seconds, cpu = time.perf_counter() - t0, cpu_s() - cpu0
    await link.close()
    gib = total / GIB
    return {"gib_s": gib / seconds, "send_cpu_per_gib": cpu / gib,
            "recv_cpu_per_gib": ack.header["cpu_s"] / gib}


def one_run(lanes: int, record: int, total: int, pin: bool,
            queue_bytes: int) -> dict[str, float]:
    child = [sys.executable, __file__, "--receive", str(lanes), str(record), str(total)]
    if pin:
        child = ["taskset", "-c", "1", *child]
    proc = subprocess.Popen(child, stdout=subprocess.PIPE, text=True)
    try:
        port = json.loads(proc.stdout.readline())["port"]
        return asyncio.run(asyncio.wait_for(send(port, lanes, total, queue_bytes), 300))
    finally:
        proc.wait(timeout=30)


def queue_bytes(choice: str, lanes: int) -> int:
    default = LinkConfig().send_queue_bytes
    if choice == "default":
        return default
    if choice == "per-lane":  # as nodes.roles.kv_link_config sizes it
        return max(default, lanes * (FRAME_BYTES + 64 * 1024))
    return parse_bytes(choice)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--receive", nargs=3, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--lanes", default="1,2,4")
    parser.add_argument("--records", default="256k,1m,4m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction,
                        default=(os.cpu_count() or 1) >= 2)
    parser.add_argument("--queue", default="default",
                        help="the sender's send_queue_bytes: 'default' (LinkConfig's), "
                        "'per-lane' (a whole KV frame a lane) or a size (64m)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.receive:
        asyncio.run(receive(*args.receive))
        return
    if args.pin:
        os.sched_setaffinity(0, {0})
    total = int(args.gib * GIB) // FRAME_BYTES * FRAME_BYTES
    print(f"bulk lanes: {total / GIB:.2f} GiB in {FRAME_BYTES >> 20} MiB frames, "
          f"{os.cpu_count()} cores, pinned {args.pin}, load {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for record in (parse_bytes(r) for r in args.records.split(",")):
        for lanes in (int(n) for n in args.lanes.split(",")):
            queue = queue_bytes(args.queue, lanes)
            runs = [one_run(lanes, record, total, args.pin, queue) for _ in range(args.repeats)]
            row = {"record": record, "lanes": lanes, "queue": queue,
                   **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
            rows.append(row)
            print(f"queue {queue >> 20:3d} MiB  record {record >> 10:5d} KiB  lanes {lanes}  "
                  f"{row['gib_s']:.2f} GiB/s  send {row['send_cpu_per_gib']:.2f}  "
                  f"recv {row['recv_cpu_per_gib']:.2f} CPU-s/GiB (median of {len(runs)})",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "load": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
