"""Router overhead: a router + zero-cost fake-engine nodes vs a plain FastAPI SSE endpoint.

Both servers are measured in the same run, alternating, with the same client:

* plain: one uvicorn process whose endpoint streams the same SSE chunks a
  chat completion would (pre-rendered token texts), no engine, no links;
* router: ``LocalCluster`` with one prefill and one decode node on engine
  ``fake`` (no model work) and the router in front of them.

Figures: time to first token p50/p99 at concurrency 1 (the router's added
latency is the difference), and SSE tokens/s with ``--concurrency`` streams.
The router process and the plain server are each pinned to one core
(``--core``), so tokens/s is "relayed on one core". The client and the fake
nodes share the other core, so the throughput client is the lean one in
``sse_relay_client`` (an httpx client that parses each event as JSON would
set the pace itself); the server's CPU time per relayed token is printed
beside it as a cross-check that does not depend on who set the pace.

Usage: python loadtests/bench_router_overhead.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    LOOPBACK,
    add_common_args,
    bench_result,
    percentile,
    stream_request,
    table,
    write_json,
)
from sse_relay_client import relay_run  # noqa: E402

MODEL = "bench"
PLAIN_APP = "plain_sse_app"


# ---------------------------------------------------------------- the plain endpoint


def plain_app_source(token_texts: list[str]) -> str:
    """A FastAPI app streaming one chat chunk per token, like the front does."""
    return f'''
import json, time, uuid
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

TEXTS = {token_texts!r}
app = FastAPI()

def event(obj):
    return ("data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
            + "\\n\\n").encode()

@app.get("/health")
def health():
    return {{"status": "ok"}}

@app.post("/v1/chat/completions")
async def chat(request: Request):
    body = await request.json()
    n = min(int(body.get("max_tokens", 16)), len(TEXTS))
    meta = {{"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion.chunk",
             "created": int(time.time()), "model": "{MODEL}", "system_fingerprint": None}}

    async def stream():
        yield event({{**meta, "choices": [{{"index": 0, "delta": {{"role": "assistant",
                      "content": ""}}, "logprobs": None, "finish_reason": None}}]}})
        for text in TEXTS[:n]:
            yield event({{**meta, "choices": [{{"index": 0, "delta": {{"content": text}},
                          "logprobs": None, "finish_reason": None}}]}})
        yield event({{**meta, "choices": [{{"index": 0, "delta": {{}}, "logprobs": None,
                      "finish_reason": "length"}}]}})
        yield b"data: [DONE]\\n\\n"

    return StreamingResponse(stream(), media_type="text/event-stream")
'''


def start_plain(workdir: Path, token_texts: list[str], core: int):
    import subprocess

    from mlxcel_plugin.local_cluster import NodeProcess, free_port

    (workdir / f"{PLAIN_APP}.py").write_text(plain_app_source(token_texts))
    port = free_port()
    argv = [sys.executable, "-m", "uvicorn", f"{PLAIN_APP}:app", "--host", LOOPBACK,
            "--port", str(port), "--log-level", "warning"]
    log_path = workdir / "plain.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(argv, cwd=workdir, stdout=log, stderr=subprocess.STDOUT)
    node = NodeProcess("plain", port, None, log_path, process, argv)
    node.wait_healthy(60)
    pin(process.pid, core)
    return node


def pin(pid: int, core: int) -> None:
    if hasattr(os, "sched_setaffinity") and core < (os.cpu_count() or 1):
        os.sched_setaffinity(pid, {core})


# ---------------------------------------------------------------- the cluster


def fake_model_dir(root: Path) -> str:
    """Tokenizer files of the tiny checkpoint (no weights) + fake-engine knobs (zero cost)."""
    import shutil

    from engines.model_store import ensure_tiny_model

    tiny = Path(ensure_tiny_model())
    root.mkdir(parents=True, exist_ok=True)
    for path in tiny.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, root / path.name)
    (root / "fake_engine.json").write_text(json.dumps({"decode_step_s": 0.0}))
    return str(root)


def start_router_cluster(workdir: Path, model: str, core: int):
    from mlxcel_plugin.local_cluster import LocalCluster

    args = ["--engine", "fake", "--served-model-name", MODEL, "--no-warmup",
            "--log-level", "warning"]
    cluster = LocalCluster(workdir=workdir, model=model, common_args=args).start(120)
    for node in cluster.nodes:
        # The router gets its core to itself; the nodes share the client's.
        pin(node.process.pid, core if node.role == "router" else other_core(core))
    return cluster


def other_core(core: int) -> int:
    return (core + 1) % (os.cpu_count() or 1)


def router_token_texts(url: str, max_tokens: int) -> list[str]:
    """What the router streams for the bench prompt, so the plain endpoint sends the same."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "bench"}],
            "max_tokens": max_tokens, "stream": True}
    texts = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    content = choice.get("delta", {}).get("content")
                    if content:
                        texts.append(content)
    return texts


# ---------------------------------------------------------------- measuring


def body(max_tokens: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "bench"}],
            "max_tokens": max_tokens, "stream": True}


def ttft_ms(url: str, n: int, max_tokens: int) -> list[float]:
    with httpx.Client(timeout=60) as client:
        results = [stream_request(client, url, "chat", "/v1/chat/completions", body(max_tokens))
                   for _ in range(n)]
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{url}: {bad[0]}")
    return [r.ttft_s * 1000 for r in results]


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def relay_figures(url: str, server_pid: int, args: argparse.Namespace) -> dict[str, float]:
    """Tokens/s through the lean client, and the server's CPU time per relayed token."""
    cpu_before = process_cpu_s(server_pid)
    run = relay_run(url, body(args.stream_tokens), concurrency=args.concurrency,
                    requests=args.stream_requests)
    cpu_s = process_cpu_s(server_pid) - cpu_before
    if run.responses != args.stream_requests or run.tokens != run.responses * args.deltas:
        raise RuntimeError(f"{url}: {run.responses} streams, {run.tokens} content deltas; "
                           f"expected {args.stream_requests} x {args.deltas}")
    return {"tok_s": run.tokens_per_s, "cpu_us_per_token": cpu_s / run.tokens * 1e6}


def measure(servers: dict[str, tuple[str, int]], args: argparse.Namespace) -> dict[str, dict]:
    """``servers``: name -> (url, pid of the process on the measured core)."""
    figures: dict[str, dict] = {name: {"ttft_ms": [], "tok_s": [], "cpu_us": []}
                                for name in servers}
    for _ in range(args.repeats):  # alternate, so both see the same machine load
        for name, (url, _) in servers.items():
            figures[name]["ttft_ms"] += ttft_ms(url, args.ttft_requests, 4)
        for name, (url, pid) in servers.items():
            relay = relay_figures(url, pid, args)
            figures[name]["tok_s"].append(relay["tok_s"])
            figures[name]["cpu_us"].append(relay["cpu_us_per_token"])
    return figures


def report(figures: dict[str, dict], args: argparse.Namespace) -> dict:
    plain, router = figures["plain"], figures["router"]
    p50 = {k: percentile(v["ttft_ms"], 50) for k, v in figures.items()}
    p99 = {k: percentile(v["ttft_ms"], 99) for k, v in figures.items()}
    tok = {k: max(v["tok_s"]) for k, v in figures.items()}
    cpu = {k: min(v["cpu_us"]) for k, v in figures.items()}
    added_p50, added_p99 = p50["router"] - p50["plain"], p99["router"] - p99["plain"]
    ratio = tok["router"] / tok["plain"]
    capacity_ratio = cpu["plain"] / cpu["router"]
    rows = [
        ["TTFT p50 (ms)", f"{p50['plain']:.2f}", f"{p50['router']:.2f}", f"{added_p50:+.2f}"],
        ["TTFT p99 (ms)", f"{p99['plain']:.2f}", f"{p99['router']:.2f}", f"{added_p99:+.2f}"],
        [f"SSE tokens/s ({args.concurrency} streams)", f"{tok['plain']:.0f}",
         f"{tok['router']:.0f}", f"{ratio:.2f}x"],
        ["server CPU us per token", f"{cpu['plain']:.2f}", f"{cpu['router']:.2f}",
         f"{capacity_ratio:.2f}x"],
    ]
    print(f"{'':32} {'plain':>10} {'router':>10} {'router-plain':>13}")
    for row in rows:
        print(f"{row[0]:32} {row[1]:>10} {row[2]:>10} {row[3]:>13}")
    print(f"added TTFT p50 {added_p50:.2f} ms (target < 1), p99 {added_p99:.2f} ms (target < 5); "
          f"relay {ratio:.2f}x the plain endpoint (target >= 1.0); tokens per CPU-second "
          f"{capacity_ratio:.2f}x")
    return bench_result(
        "router_overhead",
        [table("Router overhead vs a plain FastAPI SSE endpoint",
               ["figure", "plain", "router", "router vs plain"], rows)],
        {"plain_ttft_ms": plain["ttft_ms"], "router_ttft_ms": router["ttft_ms"],
         "plain_tokens_per_s": plain["tok_s"], "router_tokens_per_s": router["tok_s"],
         "plain_cpu_us_per_token": plain["cpu_us"], "router_cpu_us_per_token": router["cpu_us"],
         "added_ttft_p50_ms": [added_p50], "added_ttft_p99_ms": [added_p99],
         "relay_ratio": [ratio], "cpu_capacity_ratio": [capacity_ratio]},
    )


def main(argv: list[str] | None = None) -> int:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--core", type=int, default=0, help="core for the router/plain server")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    args.ttft_requests = 50 if args.quick else 300
    args.stream_requests = 32 if args.quick else 128
    args.stream_tokens = 128 if args.quick else 512
    if args.quick:
        args.repeats = 1
    pin(os.getpid(), other_core(args.core))  # the client stays off the measured core
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        workdir = Path(tmp)
        cluster = start_router_cluster(workdir / "cluster", fake_model_dir(workdir / "model"),
                                       args.core)
        plain = None
        try:
            texts = router_token_texts(cluster.router.url, args.stream_tokens)
            args.deltas = len(texts)  # tokens that decode to no text yet send no delta
            plain = start_plain(workdir, texts, args.core)
            figures = measure({"plain": (plain.url, plain.process.pid),
                               "router": (cluster.router.url, cluster.router.process.pid)}, args)
        finally:
            cluster.stop()
            if plain is not None:
                plain.stop()
    result = report(figures, args)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
