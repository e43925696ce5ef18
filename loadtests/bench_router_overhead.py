"""Router overhead: a router over zero-cost nodes vs a plain FastAPI SSE endpoint.

All servers are measured in the same run, alternating, with the same client:

* plain: one uvicorn process whose endpoint streams the same SSE chunks a
  chat completion would (pre-rendered token texts), no engine, no links;
* router: the router in front of zero-cost peers
  (``mlxcel_plugin.testing.fake_peers``: a prefill and a decode that speak the
  link protocol and answer at once), so every figure is the router's own cost
  plus the one network hop a disaggregated request cannot avoid;
* router+nodes (reference): the router in front of real prefill and decode
  nodes on engine ``fake``; it adds the nodes' own work (scheduling, the KV
  handoff between them), which on this machine shares the client's core.

Figures: time to first token p50/p99 at concurrency 1 (the router's added
latency is the difference), and SSE tokens/s with ``--concurrency`` streams.
The router process and the plain server are each pinned to one core
(``--core``), so tokens/s is "relayed on one core". The client and the peers
share the other core, so the throughput client is the lean one in
``sse_relay_client`` (an httpx client that parses each event as JSON would
set the pace itself); the server's CPU time per relayed token is printed
beside it as a cross-check that does not depend on who set the pace.

Usage: python loadtests/bench_router_overhead.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from bench_common import (  # noqa: E402
    LOOPBACK,
    add_common_args,
    bench_result,
    percentile,
    stream_request,
    table,
    write_json,
)
from harness import proc_cpu_s  # noqa: E402
from sse_relay_client import relay_run  # noqa: E402

from mlxcel_plugin.local_cluster import free_port, pin_process  # noqa: E402

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
    from mlxcel_plugin.local_cluster import NodeProcess

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
    """Every thread of ``pid`` on ``core`` (when this machine has it)."""
    if core < (os.cpu_count() or 1):
        pin_process(pid, {core})


# ---------------------------------------------------------------- the cluster


def fake_model_dir(root: Path) -> str:
    """Tokenizer files of the tiny checkpoint (no weights) + fake-engine knobs (zero cost)."""
    from engines.model_store import ensure_tiny_model

    return str(harness.fake_model_dir(root, Path(ensure_tiny_model()), {"decode_step_s": 0.0}))


def start_router_cluster(workdir: Path, model: str, core: int):
    from mlxcel_plugin.local_cluster import LocalCluster

    args = ["--engine", "fake", "--served-model-name", MODEL, "--no-warmup",
            "--log-level", "warning"]
    cluster = LocalCluster(workdir=workdir, model=model, common_args=args).start(120)
    for node in cluster.nodes:
        # The router gets its core to itself; the nodes share the client's.
        pin(node.process.pid, core if node.role == "router" else other_core(core))
    return cluster


def start_router_over_fake_peers(workdir: Path, model: str, core: int):
    """The router process, pinned to ``core``, over zero-cost peers on the other core."""
    from mlxcel_plugin.link.protocol.secret import generate_secret_file
    from mlxcel_plugin.local_cluster import start_node

    workdir.mkdir(parents=True, exist_ok=True)
    secret = workdir / "cluster.secret"
    generate_secret_file(secret)
    prefill, decode = f"{LOOPBACK}:{free_port()}", f"{LOOPBACK}:{free_port()}"
    argv = [sys.executable, "-m", "mlxcel_plugin.testing.fake_peers", "--cluster-secret-file",
            str(secret), "--prefill-bind", prefill, "--decode-bind", decode]
    with open(workdir / "fake-peers.log", "ab") as log:
        peers = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    pin(peers.pid, other_core(core))
    router = start_node("router", workdir, [
        "--cluster-secret-file", str(secret), "--model", model, "--served-model-name", MODEL,
        "--no-warmup", "--log-level", "warning", "--prefill-peers", prefill,
        "--decode-peers", decode], cpu_affinity={core})
    try:
        router.wait_healthy(120)
    except BaseException:
        router.stop()
        peers.terminate()
        raise
    return router, peers


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


def relay_figures(url: str, server_pid: int, deltas: int,
                  args: argparse.Namespace) -> dict[str, float]:
    """Tokens/s through the lean client, and the server's CPU time per relayed token."""
    cpu_before = proc_cpu_s(server_pid)
    run = relay_run(url, body(args.stream_tokens), concurrency=args.concurrency,
                    requests=args.stream_requests)
    cpu_s = proc_cpu_s(server_pid) - cpu_before
    if run.responses != args.stream_requests or run.tokens != run.responses * deltas:
        raise RuntimeError(f"{url}: {run.responses} streams, {run.tokens} content deltas; "
                           f"expected {args.stream_requests} x {deltas}")
    return {"tok_s": run.tokens_per_s, "cpu_us_per_token": cpu_s / run.tokens * 1e6}


@dataclass
class Server:
    url: str
    pid: int  # the process on the measured core
    deltas: int  # content deltas per stream of ``--stream-tokens`` tokens


def measure(servers: dict[str, Server], args: argparse.Namespace) -> dict[str, dict]:
    figures: dict[str, dict] = {name: {"ttft_ms": [], "tok_s": [], "cpu_us": []}
                                for name in servers}
    for server in servers.values():  # unrecorded: first connections, lazy imports, caches
        ttft_ms(server.url, 20, 4)
    for _ in range(args.repeats):  # alternate, so all see the same machine load
        for name, server in servers.items():
            figures[name]["ttft_ms"] += ttft_ms(server.url, args.ttft_requests, 4)
        for name, server in servers.items():
            relay = relay_figures(server.url, server.pid, server.deltas, args)
            figures[name]["tok_s"].append(relay["tok_s"])
            figures[name]["cpu_us"].append(relay["cpu_us_per_token"])
    return figures


def report(figures: dict[str, dict], args: argparse.Namespace) -> dict:
    names = list(figures)  # plain first
    p50 = {k: percentile(v["ttft_ms"], 50) for k, v in figures.items()}
    p99 = {k: percentile(v["ttft_ms"], 99) for k, v in figures.items()}
    tok = {k: max(v["tok_s"]) for k, v in figures.items()}
    cpu = {k: min(v["cpu_us"]) for k, v in figures.items()}
    rows = [
        ["TTFT p50 (ms)", *(f"{p50[k]:.2f}" for k in names)],
        ["TTFT p99 (ms)", *(f"{p99[k]:.2f}" for k in names)],
        ["added TTFT p50 (ms)", *(f"{p50[k] - p50['plain']:+.2f}" for k in names)],
        ["added TTFT p99 (ms)", *(f"{p99[k] - p99['plain']:+.2f}" for k in names)],
        [f"SSE tokens/s ({args.concurrency} streams)", *(f"{tok[k]:.0f}" for k in names)],
        ["relay vs plain", *(f"{tok[k] / tok['plain']:.2f}x" for k in names)],
        ["server CPU us per token", *(f"{cpu[k]:.2f}" for k in names)],
        ["tokens per CPU-second vs plain", *(f"{cpu['plain'] / cpu[k]:.2f}x" for k in names)],
    ]
    print(f"{'':32}" + "".join(f"{k:>16}" for k in names))
    for row in rows:
        print(f"{row[0]:32}" + "".join(f"{cell:>16}" for cell in row[1:]))
    added_p50, added_p99 = p50["router"] - p50["plain"], p99["router"] - p99["plain"]
    ratio = tok["router"] / tok["plain"]
    print(f"router: added TTFT p50 {added_p50:.2f} ms (target < 1), p99 {added_p99:.2f} ms "
          f"(target < 5); relay {ratio:.2f}x the plain endpoint (target >= 1.0)")
    series = {f"{k}_{figure}": figures[k][key] for k in names
              for figure, key in (("ttft_ms", "ttft_ms"), ("tokens_per_s", "tok_s"),
                                  ("cpu_us_per_token", "cpu_us"))}
    return bench_result(
        "router_overhead",
        [table("Router overhead vs a plain FastAPI SSE endpoint", ["figure", *names], rows)],
        {**series, "added_ttft_p50_ms": [added_p50], "added_ttft_p99_ms": [added_p99],
         "relay_ratio": [ratio], "cpu_capacity_ratio": [cpu["plain"] / cpu["router"]]},
    )


def main(argv: list[str] | None = None) -> int:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--core", type=int, default=0, help="core for the router/plain server")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-nodes", action="store_true",
                        help="skip the reference run over real nodes")
    args = parser.parse_args(argv)
    args.ttft_requests = 50 if args.quick else 300
    args.stream_requests = 32 if args.quick else 128
    args.stream_tokens = 128 if args.quick else 512
    if args.quick:
        args.repeats = 1
    pin(os.getpid(), other_core(args.core))  # the client stays off the measured core
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-router-")))
        model = fake_model_dir(workdir / "model")
        router, peers = start_router_over_fake_peers(workdir / "router", model, args.core)
        stack.callback(peers.terminate)
        stack.callback(router.stop)
        texts = router_token_texts(router.url, args.stream_tokens)
        plain = start_plain(workdir, texts, args.core)
        stack.callback(plain.stop)
        servers = {"plain": Server(plain.url, plain.process.pid, len(texts)),
                   "router": Server(router.url, router.process.pid, len(texts))}
        if not args.no_nodes:
            cluster = start_router_cluster(workdir / "cluster", model, args.core)
            stack.callback(cluster.stop)
            url = cluster.router.url
            servers["router+nodes"] = Server(
                url, cluster.router.process.pid, len(router_token_texts(url, args.stream_tokens)))
        figures = measure(servers, args)
    result = report(figures, args)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
