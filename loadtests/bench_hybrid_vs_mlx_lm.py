"""Hybrid node vs ``mlx_lm server`` on the same checkpoint and the same requests.

Starts both servers on 127.0.0.1, sends identical streaming chat requests at
each concurrency level, and reports throughput (generated tokens/s), TTFT and
inter-token latency (p50/p99) with the hybrid/mlx-lm ratio. Bounded: a fixed
number of requests per level and an overall deadline.

    python loadtests/bench_hybrid_vs_mlx_lm.py [--quick] [--json PATH] [--model DIR]
        [--requests 16] [--max-tokens 64] [--concurrency 1,8] [--deadline-s 600]

``--quick``: 8 requests of 32 tokens per level (about 10 s, mostly server start-up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from bench_common import (
    add_common_args,
    bench_result,
    percentile,
    start_hybrid,
    start_mlx_lm_server,
    table,
    write_json,
)

from mlxcel_plugin.local_cluster import NodeProcess

HEALTH_TIMEOUT_S = 180
PROMPTS = [
    "Write a short story about a fox.",
    "Explain how a rainbow forms.",
    "List three uses for a paperclip.",
    "Describe the city of Paris in spring.",
]


@dataclass
class Sample:
    ttft_s: float
    itl_s: list[float]
    tokens: int


@dataclass
class LevelResult:
    server: str
    concurrency: int
    wall_s: float
    samples: list[Sample] = field(default_factory=list)
    errors: int = 0

    @property
    def tokens_per_s(self) -> float:
        return sum(s.tokens for s in self.samples) / self.wall_s if self.wall_s else 0.0

    def summary(self) -> dict[str, float]:
        ttft = [s.ttft_s for s in self.samples]
        itl = [gap for s in self.samples for gap in s.itl_s]
        return {
            "tokens_per_s": self.tokens_per_s,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50),
            "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "itl_p50_ms": 1e3 * percentile(itl, 50),
            "itl_p99_ms": 1e3 * percentile(itl, 99),
            "errors": float(self.errors),
        }


def start_server(name: str, model: str, workdir: Path) -> NodeProcess:
    # Both get OpenBLAS: the CLI re-executes with it, bench_common preloads it for mlx_lm.
    starter = start_hybrid if name == "hybrid" else start_mlx_lm_server
    return starter(model, workdir / name, HEALTH_TIMEOUT_S)


async def one_request(client: httpx.AsyncClient, body: dict) -> Sample:
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError("no content streamed")
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return Sample(stamps[0] - start, gaps, tokens)


async def run_level(
    name: str, base_url: str, model_field: str, args: argparse.Namespace, concurrency: int
) -> LevelResult:
    bodies = [
        {"model": model_field, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
         "max_tokens": args.max_tokens, "temperature": 0.0, "stream": True,
         "stream_options": {"include_usage": True}}
        for i in range(args.requests)
    ]  # fmt: skip
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=args.request_timeout_s) as client:
        await one_request(client, bodies[0])  # warm-up, not measured

        async def bounded(body: dict) -> Sample | Exception:
            async with limit:
                try:
                    return await one_request(client, body)
                except (httpx.HTTPError, RuntimeError) as exc:
                    return exc

        start = time.perf_counter()
        outcomes = await asyncio.gather(*(bounded(b) for b in bodies))
        result = LevelResult(name, concurrency, time.perf_counter() - start)
    for outcome in outcomes:
        if isinstance(outcome, Sample):
            result.samples.append(outcome)
        else:
            result.errors += 1
            print(f"  {name} c={concurrency}: request failed: {outcome}", file=sys.stderr)
    return result


def bench_server(
    name: str, model_field: str, args: argparse.Namespace, workdir: Path
) -> list[LevelResult]:
    server = start_server(name, args.model, workdir)
    try:
        return [
            asyncio.run(asyncio.wait_for(
                run_level(name, server.url, model_field, args, c), timeout=args.deadline_s
            ))
            for c in args.concurrency
        ]  # fmt: skip
    finally:
        server.stop()


SUMMARY_KEYS = ["tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "errors"]
COLUMNS = ["metric", "clients", "hybrid", "mlx_lm", "hybrid / mlx_lm"]


def comparison_rows(hybrid: list[LevelResult], mlx_lm: list[LevelResult]) -> list[list[Any]]:
    """One row per metric and concurrency level, with the hybrid/mlx-lm ratio."""
    rows = []
    for h, m in zip(hybrid, mlx_lm, strict=True):
        hs, ms = h.summary(), m.summary()
        for key in SUMMARY_KEYS:
            ratio = hs[key] / ms[key] if ms[key] else float("nan")
            rows.append([key, h.concurrency, round(hs[key], 2), round(ms[key], 2), round(ratio, 2)])
    return rows


def print_report(rows: list[list[Any]]) -> None:
    print(f"{'metric':<14}{'conc':>5}{'hybrid':>12}{'mlx_lm':>12}{'ratio':>8}")
    for key, clients, hybrid, mlx_lm, ratio in rows:
        print(f"{key:<14}{clients:>5}{hybrid:>12.2f}{mlx_lm:>12.2f}{ratio:>8.2f}")
    print("ratio = hybrid / mlx_lm (throughput: higher is better; latencies: lower is better)")


def result_json(
    rows: list[list[Any]], hybrid: list[LevelResult], mlx_lm: list[LevelResult], args: Any
) -> dict[str, Any]:
    series = {
        "clients": [r.concurrency for r in hybrid],
        "hybrid_tokens_per_s": [round(r.tokens_per_s, 1) for r in hybrid],
        "mlx_lm_tokens_per_s": [round(r.tokens_per_s, 1) for r in mlx_lm],
    }
    plot = {
        "x": "clients",
        "y": ["hybrid_tokens_per_s", "mlx_lm_tokens_per_s"],
        "title": "Generated tokens/s, hybrid node vs mlx_lm server",
        "xlabel": "concurrent clients",
        "ylabel": "tokens/s",
        "logx": True,
    }
    title = (
        f"Hybrid node vs mlx_lm server, {args.requests} chat requests x {args.max_tokens} "
        "tokens per level (ratio = hybrid / mlx_lm; throughput: higher is better)"
    )
    return bench_result("hybrid_vs_mlx_lm", [table(title, COLUMNS, rows)], series, plot)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--model", help="checkpoint dir (default: the tiny test model)")
    parser.add_argument("--requests", type=int, default=0, help="requests per level (16)")
    parser.add_argument("--max-tokens", type=int, default=0, help="tokens per request (64)")
    parser.add_argument("--concurrency", default="1,8", help="comma-separated levels")
    parser.add_argument("--deadline-s", type=float, default=600, help="per level")
    parser.add_argument("--request-timeout-s", type=float, default=120)
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.requests = args.requests or (8 if args.quick else 16)
    args.max_tokens = args.max_tokens or (32 if args.quick else 64)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.model is None:
        from engines.model_store import ensure_tiny_model

        args.model = str(ensure_tiny_model())
    with tempfile.TemporaryDirectory(prefix="bench-hybrid-") as workdir:
        hybrid = bench_server("hybrid", Path(args.model).name, args, Path(workdir))
        mlx_lm = bench_server("mlx_lm", args.model, args, Path(workdir))
    rows = comparison_rows(hybrid, mlx_lm)
    print_report(rows)
    if args.json:
        write_json(args.json, result_json(rows, hybrid, mlx_lm, args))


if __name__ == "__main__":
    main()
