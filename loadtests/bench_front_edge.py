"""The HTTP front's edge: per-request cost of validation and the API-key check, and
how long other streams stall while a 10 MB prompt arrives.

Two measurements:

* front cost: the app is driven in-process through raw ASGI calls (no sockets,
  no HTTP client), ``--requests`` sequential non-streaming chat requests over
  an engine that answers one token at once; the figure is the median
  microseconds per request, without and with ``--api-key`` (one Bearer check
  per request). Differences between versions of the front show up here,
  undiluted by network and client cost.
* 10 MB stall: a hybrid node (``--engine fake``, a token every
  ``--token-step-ms``, ``--max-request-bytes`` 32 MiB) serves ``--streams``
  streams; their largest inter-token gap is measured without load, then while
  one 10 MB prompt is posted from another thread: with the checkpoint's
  2048-token context it is a 413 from its ``Content-Length`` (no prompt within
  that context needs 10 MB); with a 1M-token context it is read, parsed,
  templated and tokenized in a worker thread, then refused (400) by its count.

Usage: python loadtests/bench_front_edge.py [--quick] [--json PATH] [--base DIR]
(``--base DIR``: measure the front cost of another checkout, e.g. the previous commit).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from bench_common import (  # noqa: E402
    LOOPBACK,
    add_common_args,
    bench_result,
    format_table,
    table,
    write_json,
)

REPO = Path(__file__).resolve().parents[1]
KEY = "sk-bench-edge"
BODY = json.dumps({"model": "bench", "max_tokens": 4,
                   "messages": [{"role": "user", "content": "Say hi to everyone here."}]}).encode()


# ---------------------------------------------------------------- front cost (in-process)


async def _asgi_post(app, body: bytes, headers: list[tuple[bytes, bytes]]) -> int:
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("t", 80),
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()), *headers],
    }  # fmt: skip
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    status = 0
    never = asyncio.Event()

    async def receive():
        if messages:
            return messages.pop()
        await never.wait()  # the disconnect watcher waits here until cancelled
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


class InstantBackend:
    """Answers every request with one token at once: no engine thread, only the front's work."""

    def __init__(self, token_id: int):
        self.token_id = token_id

    def is_ready(self) -> bool:
        return True

    async def stream(self, request):
        from mlxcel_plugin.engine_api import TokenEvent

        yield [TokenEvent(request.request_id, 0, self.token_id, finish_reason="length")]


def _make_app(tokenizer, with_key: bool):
    from router_plugin.http.front import make_app

    backend = InstantBackend(tokenizer.encode("hi", add_special_tokens=False)[0])
    kwargs = {}
    if with_key:
        if "options" not in inspect.signature(make_app).parameters:
            return None
        from router_plugin.http.options import FrontOptions

        kwargs["options"] = FrontOptions(api_keys=frozenset({KEY}))
    return make_app(backend, tokenizer, "bench", **kwargs)


async def _front_cost_us(app, requests: int, headers) -> float:
    for _ in range(50):  # warm up (template compile, caches)
        assert await _asgi_post(app, BODY, headers) == 200
    samples = []
    for _ in range(requests):
        start = time.process_time()  # CPU time: other processes on the machine do not count
        status = await _asgi_post(app, BODY, headers)
        samples.append(time.process_time() - start)
        assert status == 200, status
    return statistics.mean(samples) * 1e6


def front_cost(model_dir: str, requests: int, rounds: int = 5) -> dict[str, float | None]:
    """Mean CPU µs per request, the best of ``rounds`` alternating rounds per variant."""
    from mlxcel_plugin.text import TextTokenizer

    tokenizer = TextTokenizer.from_dir(model_dir)
    variants = {"no_key": False, "api_key": True}
    apps = {name: _make_app(tokenizer, with_key) for name, with_key in variants.items()}
    best: dict[str, float | None] = dict.fromkeys(variants)
    for _ in range(rounds):
        for name, app in apps.items():
            if app is None:
                continue
            headers = [(b"authorization", f"Bearer {KEY}".encode())] if variants[name] else []
            cost = asyncio.run(_front_cost_us(app, requests, headers))
            best[name] = cost if best[name] is None else min(best[name], cost)
    return best


# ---------------------------------------------------------------- 10 MB stall (real sockets)


def fake_model_dir(root: Path, tiny: Path, token_step_ms: float,
                   context_tokens: int | None) -> Path:  # fmt: skip
    knobs = {"decode_step_s": token_step_ms / 1000}
    return harness.fake_model_dir(root, tiny, knobs, context_tokens)


def start_hybrid(model_dir: Path, port: int, extra: list[str]) -> subprocess.Popen:
    argv = [sys.executable, "-m", "mlxcel_plugin.cli", "--engine", "fake", "--model",
            str(model_dir), "--served-model-name", "bench", "--port", str(port),
            "--no-warmup", "--log-level", "warning", *extra]  # fmt: skip
    process = subprocess.Popen(argv, cwd=REPO)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # bounded by the deadline
        try:
            if httpx.get(f"http://{LOOPBACK}:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError("the hybrid node did not come up")


async def _stream_gaps(client: httpx.AsyncClient, max_tokens: int) -> list[float]:
    body = {"model": "bench", "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "Count."}]}
    gaps, last = [], None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    return gaps[1:]  # the role chunk and the first token share a write


def post_big(url: str, body: bytes) -> tuple[int, float]:
    """From a worker thread: the measuring loop does not serialize or send the 10 MB."""
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/chat/completions", content=body, timeout=120,
                          headers={"content-type": "application/json"})
    return response.status_code, time.perf_counter() - start


async def streams_with_load(url: str, streams: int, max_tokens: int,
                            big_body: bytes | None) -> tuple[list[float], int | None, float]:
    """Inter-token gaps of ``streams`` streams; ``big_body`` posted once they run."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        tasks = [asyncio.create_task(_stream_gaps(client, max_tokens)) for _ in range(streams)]
        status, answered_s = None, 0.0
        if big_body is not None:
            await asyncio.sleep(0.5)
            status, answered_s = await asyncio.to_thread(post_big, url, big_body)
        gaps = [gap for task in tasks for gap in await task]
    return gaps, status, answered_s


def ten_mb_body() -> bytes:
    text = "word " * (10_000_000 // 5)
    return json.dumps({"model": "bench", "messages": [{"role": "user", "content": text}]}).encode()


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def stall(tiny: Path, workdir: Path, args: argparse.Namespace) -> list[list]:
    from mlxcel_plugin.local_cluster import free_port

    rows = []
    for label, context_tokens in (("2048-token context", None), ("1M-token context", 1 << 20)):
        model_dir = fake_model_dir(workdir / f"model-{context_tokens}", tiny, args.token_step_ms,
                                   context_tokens)  # fmt: skip
        port = free_port()
        process = start_hybrid(model_dir, port, ["--max-request-bytes", str(32 << 20)])
        try:
            url = f"http://{LOOPBACK}:{port}"
            calm, _, _ = asyncio.run(streams_with_load(url, args.streams, args.max_tokens, None))
            gaps, status, answered_s = asyncio.run(
                streams_with_load(url, args.streams, args.max_tokens, ten_mb_body()))
            rows.append([label, round(p99(calm) * 1e3, 1), round(max(calm) * 1e3, 1),
                         round(max(gaps) * 1e3, 1), round(max(gaps) / p99(calm), 2), status,
                         round(answered_s * 1e3, 1)])  # fmt: skip
        finally:
            process.terminate()
            process.wait(10)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--token-step-ms", type=float, default=50.0)
    parser.add_argument("--base", help="another checkout whose front cost to measure too")
    parser.add_argument("--skip-stall", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.max_tokens = 1000, 60
    from engines.model_store import ensure_tiny_model

    tiny = ensure_tiny_model(root=REPO / ".cache" / "mlxcel")
    cost_rows = [["this tree", *front_cost(str(tiny), args.requests).values()]]
    if args.base:
        code = (f"import sys; sys.path[:0] = [{args.base!r}, {str(REPO / 'loadtests')!r}];"
                f"import bench_front_edge as b, json;"
                f"print(json.dumps(b.front_cost({str(tiny)!r}, {args.requests})))")
        out = subprocess.run([sys.executable, "-c", code], cwd=args.base, check=True,
                             capture_output=True, text=True, env={**os.environ,
                                                                  "PYTHONPATH": args.base})
        cost_rows.append([f"base {args.base}", *json.loads(out.stdout.splitlines()[-1]).values()])
    cost = [[r[0], *(None if v is None else round(v, 1) for v in r[1:])] for r in cost_rows]
    tables = [table("front CPU per request, µs (in-process ASGI, best of 5 rounds)",
                    ["tree", "no key", "with --api-key"], cost)]
    if not args.skip_stall:
        import tempfile

        with tempfile.TemporaryDirectory() as workdir:
            rows = stall(tiny, Path(workdir), args)
        tables.append(table(f"{args.streams} streams while a 10 MB prompt arrives (ms)",
                       ["model", "unloaded p99 gap", "unloaded max gap", "loaded max gap",
                        "loaded max / unloaded p99", "10 MB status", "10 MB answered in"],
                       rows))  # fmt: skip
    for result_table in tables:
        print(format_table(result_table))
    if args.json:
        write_json(args.json, bench_result("front_edge", tables, {}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
