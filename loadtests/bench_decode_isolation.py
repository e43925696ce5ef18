"""Decode isolation: inter-token latency of running streams, alone and while long prompts arrive.

Hybrid: one engine process does both (a 2k-token prefill stalls every running
stream for its duration). Disaggregated: a prefill node and a decode node as
separate processes, driven over real links by ``LinkDriver`` (the router's
role); the long prompts' KV arrives at the decode node through ingestion,
which never blocks a decode step. Target: disaggregated p99 ITL under load
<= 1.25x unloaded.

Both modes share this machine's cores: on a 2-core box the prefill process
competes with the decode process for CPU, which is not isolation a real
deployment (separate machines) would have. The figures say what they measure.

    python loadtests/bench_decode_isolation.py [--quick] [--json PATH] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import add_common_args, bench_result, summarize, table, write_json  # noqa: E402

from mlxcel_plugin import openblas  # noqa: E402
from mlxcel_plugin.local_cluster import LOOPBACK, free_port, start_node  # noqa: E402
from mlxcel_plugin.secret import generate_secret_file, load_cluster_secret  # noqa: E402
from mlxcel_plugin.testing.link_driver import LinkDriver  # noqa: E402

LONG_PROMPT_TOKENS = 2000


def stream_prompt(i: int) -> list[int]:
    return [(13 * j + i) % 4000 + 100 for j in range(32)]


def long_prompt(i: int) -> list[int]:
    return [(7 * j + 31 * i) % 4000 + 100 for j in range(LONG_PROMPT_TOKENS)]


def gaps(times: list[float], skip: int = 1) -> list[float]:
    """Gaps between token arrivals, after the first ``skip`` (joining the batch)."""
    times = times[skip:]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


# ---------------------------------------------------------------- hybrid (child process)


def hybrid_child(model: str, streams: int, tokens: int, loaded: bool) -> None:
    """Runs in its own process: prints {"itl": [...], "long_prompts": n} as JSON."""
    from engines.mlx_engine import MlxEngine
    from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest

    engine = MlxEngine.from_path(model, EngineConfig())
    engine.start()
    times: dict[str, list[float]] = {f"s{i}": [] for i in range(streams)}
    finished = threading.Semaphore(0)

    def emitter(key: str):
        def emit(event) -> None:
            if event.token_id is not None:
                times[key].append(time.perf_counter())
            if event.finish_reason is not None:
                finished.release()
        return emit

    for i in range(streams):
        request = GenerationRequest(f"s{i}", tuple(stream_prompt(i)), tokens)
        engine.generate(request, emitter(f"s{i}"))
    streams_done, fed = threading.Event(), [0]

    def feed() -> None:
        while not streams_done.is_set():  # long prompts back to back until the streams end
            done = threading.Event()
            request = GenerationRequest(f"long{fed[0]}", tuple(long_prompt(fed[0])), 2)
            engine.generate(request, lambda e, d=done: e.finish_reason and d.set())
            done.wait(120)
            fed[0] += 1

    feeder = threading.Thread(target=feed, daemon=True)
    if loaded:
        feeder.start()
    for _ in range(streams):
        finished.acquire(timeout=600)
    streams_done.set()
    if loaded:
        feeder.join(120)
    long_done = fed[0]
    engine.close()
    itl = [g for key in times for g in gaps(times[key])]
    print(json.dumps({"itl": itl, "long_prompts": long_done}))


def run_hybrid(model: str, streams: int, tokens: int, loaded: bool) -> dict:
    env = openblas.preload_env(os.environ) or dict(os.environ)
    args = [sys.executable, __file__, "--hybrid-child", "--model", model, "--streams",
            str(streams), "--tokens", str(tokens)] + (["--loaded"] if loaded else [])
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- disaggregated


async def drive(driver: LinkDriver, streams: int, tokens: int, loaded: bool) -> dict:
    collectors = [await driver.submit(f"s{i}-{time.monotonic_ns()}", stream_prompt(i), tokens)
                  for i in range(streams)]
    waits = asyncio.gather(*(driver.wait(c, 600) for c in collectors))
    long_done = 0
    if loaded:
        while not all(c.done.is_set() for c in collectors):  # until every stream finished
            outcome = await driver.generate(f"long{long_done}-{time.monotonic_ns()}",
                                            long_prompt(long_done), 2, timeout_s=120)
            if not outcome.ok:
                raise RuntimeError(f"long prompt failed: {outcome}")
            long_done += 1
    outcomes = await waits
    itl = [g for o in outcomes for g in gaps(o.token_times_s[1:])]  # [0] came from prefill
    return {"itl": itl, "long_prompts": long_done}


def run_disaggregated(model: str, streams: int, tokens: int) -> dict[str, dict]:
    workdir = Path(tempfile.mkdtemp(prefix="bench-isolation-"))
    secret_path = workdir / "cluster.secret"
    generate_secret_file(secret_path)
    common = ["--cluster-secret-file", str(secret_path), "--model", model]
    decode = start_node("decode", workdir, common, serving_bind=f"{LOOPBACK}:{free_port()}")
    prefill = start_node("prefill", workdir, common, serving_bind=f"{LOOPBACK}:{free_port()}")
    try:
        decode.wait_healthy(300)
        prefill.wait_healthy(300)
        secret = load_cluster_secret(str(secret_path), {})

        async def both() -> dict[str, dict]:
            async with LinkDriver(secret, prefill.serving_bind, decode.serving_bind) as driver:
                await drive(driver, 1, 4, False)  # warm the links
                return {"unloaded": await drive(driver, streams, tokens, False),
                        "loaded": await drive(driver, streams, tokens, True)}

        return asyncio.run(both())
    finally:
        prefill.stop()
        decode.stop()


# ---------------------------------------------------------------- main


def default_model() -> str:
    from engines.model_store import ensure_tiny_model

    return str(ensure_tiny_model())


def main() -> None:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--model", help="mlx-lm checkpoint (default: the tiny test model)")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=0, help="tokens per stream")
    parser.add_argument("--hybrid-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--loaded", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    model = args.model or default_model()
    tokens = args.tokens or (120 if args.quick else 400)
    if args.hybrid_child:
        hybrid_child(model, args.streams, tokens, args.loaded)
        return
    runs = {
        ("hybrid", "unloaded"): run_hybrid(model, args.streams, tokens, False),
        ("hybrid", "loaded"): run_hybrid(model, args.streams, tokens, True),
    }
    disaggregated = run_disaggregated(model, args.streams, tokens)
    runs[("disaggregated", "unloaded")] = disaggregated["unloaded"]
    runs[("disaggregated", "loaded")] = disaggregated["loaded"]
    rows, ratios = [], {}
    for mode in ("hybrid", "disaggregated"):
        base = summarize(runs[(mode, "unloaded")]["itl"])
        for phase in ("unloaded", "loaded"):
            stats = summarize(runs[(mode, phase)]["itl"])
            rows.append([mode, phase, runs[(mode, phase)]["long_prompts"], int(stats["count"]),
                         round(stats["p50"] * 1e3, 2), round(stats["p99"] * 1e3, 2),
                         round(stats["p99"] / base["p99"], 2)])
        ratios[mode] = rows[-1][-1]
    columns = ["mode", "phase", "long prompts", "gaps", "ITL p50 ms", "ITL p99 ms",
               "p99 / unloaded p99"]
    print(f"decode isolation: {args.streams} streams x {tokens} tokens, long prompts of "
          f"{LONG_PROMPT_TOKENS} tokens, model {Path(model).name}, {os.cpu_count()} cores")
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(str(cell) for cell in row))
    verdict = "meets" if ratios["disaggregated"] <= 1.25 else "misses"
    print(f"disaggregated p99 under load = {ratios['disaggregated']}x unloaded "
          f"({verdict} the 1.25x target); hybrid {ratios['hybrid']}x")
    if args.json:
        write_json(args.json, bench_result(
            "decode_isolation", [table("ITL of running decode streams", columns, rows)],
            {"p99_ratio": [ratios["hybrid"], ratios["disaggregated"]]}))


if __name__ == "__main__":
    main()
