"""RSS per role: freshly started, under load, and some time after the load (issue 22).

Starts a prefill and a decode node (the ``fake`` engine by default, or
``--engine mlx --model PATH``), drives them over real links with
``LinkDriver`` (the router's part), and samples each process's VmRSS; then,
with ``--hybrid``, a hybrid node driven through its HTTP API the same way:

    .venv/bin/python loadtests/bench_memory.py --requests 64 --concurrency 8
    .venv/bin/python loadtests/bench_memory.py --engine mlx --model ~/.cache/mlxcel/tiny
    .venv/bin/python loadtests/bench_memory.py --engine mlx --hybrid \
        --model ~/.cache/mlxcel/SmolLM2-135M-Instruct --requests 32 --prompt-tokens 1500

Target (issue 22): an idle node at most its model's weights + 512 MiB, also
after load. Linux only (reads /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mlxcel_plugin.link import generate_secret_file, load_cluster_secret  # noqa: E402
from mlxcel_plugin.local_cluster import LOOPBACK, NodeProcess, free_port, start_node  # noqa: E402
from mlxcel_plugin.testing.link_driver import LinkDriver  # noqa: E402

MIB = 1 << 20
TRANSFER_TIMEOUT_S = 600


def rss_bytes(node: NodeProcess) -> int:
    status = Path(f"/proc/{node.process.pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def start(workdir: Path, args: argparse.Namespace,
          roles: tuple[str, ...] = ("decode", "prefill")) -> dict[str, NodeProcess]:
    secret_path = workdir / "cluster.secret"
    generate_secret_file(secret_path)
    model = args.model or str(workdir)
    # Prefills queue behind each other on a loaded machine: a claim waits for its KV that long.
    settings = workdir / "bench.toml"
    settings.write_text(f"[transfer]\ntransfer_timeout_s = {TRANSFER_TIMEOUT_S}\n")
    common = ["--cluster-secret-file", str(secret_path), "--engine", args.engine,
              "--model", model, "--distributed-config", str(settings)]
    nodes = {}
    for role in roles:
        bind = None if role == "hybrid" else f"{LOOPBACK}:{free_port()}"
        nodes[role] = start_node(role, workdir, common + ["--node-id", f"{role}-mem"],
                                 name=role, serving_bind=bind)
    for node in nodes.values():
        node.wait_healthy(300)
    return nodes


async def load(nodes: dict[str, NodeProcess], secret_path: Path, args: argparse.Namespace,
               samples: dict[str, list[int]]) -> int:
    """``requests`` generations, ``concurrency`` at a time; RSS sampled meanwhile."""
    secret = load_cluster_secret(str(secret_path), {})
    prompt = [7 + i % 50 for i in range(args.prompt_tokens)]
    done = 0
    async with LinkDriver(secret, nodes["prefill"].serving_bind,
                          nodes["decode"].serving_bind) as driver:
        gate = asyncio.Semaphore(args.concurrency)

        async def one(i: int) -> bool:
            async with gate:
                outcome = await driver.generate(f"m{i}", prompt, args.max_tokens, timeout_s=300)
                if not outcome.ok:
                    print(f"request m{i} failed: {outcome.error_code} {outcome.error}", flush=True)
                return outcome.ok

        done = await _sampled(nodes, samples, [one(i) for i in range(args.requests)])
    return done


async def _sampled(nodes: dict[str, NodeProcess], samples: dict[str, list[int]],
                   requests: list) -> int:
    """Run ``requests`` together while sampling every node's RSS; how many succeeded."""

    async def sample() -> None:
        while True:  # cancelled when the load ends
            for role, node in nodes.items():
                samples[role].append(rss_bytes(node))
            await asyncio.sleep(0.2)

    sampler = asyncio.create_task(sample())
    try:
        return sum(await asyncio.gather(*requests))
    finally:
        sampler.cancel()


async def load_http(nodes: dict[str, NodeProcess], args: argparse.Namespace,
                    samples: dict[str, list[int]]) -> int:
    """The same load through a hybrid node's ``/v1/completions`` (token-id prompts)."""
    import httpx

    node = nodes["hybrid"]
    prompt = [7 + i % 50 for i in range(args.prompt_tokens)]
    gate = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=f"http://{LOOPBACK}:{node.port}",
                                 timeout=300) as client:

        async def one(i: int) -> bool:
            body = {"prompt": prompt, "max_tokens": args.max_tokens,
                    "temperature": 0}
            async with gate:
                response = await client.post("/v1/completions", json=body)
                if response.status_code != 200:
                    print(f"request {i} failed: {response.status_code} {response.text[:200]}",
                          flush=True)
                return response.status_code == 200

        return await _sampled(nodes, samples, [one(i) for i in range(args.requests)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="fake")
    parser.add_argument("--model", default="")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--after-s", type=float, default=30.0,
                        help="idle time before the last look")
    parser.add_argument("--hybrid", action="store_true",
                        help="then measure a hybrid node under the same load (HTTP)")
    args = parser.parse_args()
    print(f"engine={args.engine} model={args.model or '-'} requests={args.requests} "
          f"concurrency={args.concurrency} prompt_tokens={args.prompt_tokens} "
          f"max_tokens={args.max_tokens}")
    print(f"{'role':8} {'fresh MiB':>10} {'load peak MiB':>14} {f'+{args.after_s:.0f}s MiB':>10}"
          f" {'ok':>4}")
    measure(args, ("decode", "prefill"), lambda nodes, workdir, samples: load(
        nodes, workdir / "cluster.secret", args, samples))
    if args.hybrid:
        measure(args, ("hybrid",), lambda nodes, _, samples: load_http(nodes, args, samples))


def measure(args: argparse.Namespace, roles: tuple[str, ...], drive) -> None:  # noqa: ANN001
    """Start ``roles``, look at their RSS fresh, under ``drive``'s load and after it."""
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        nodes = start(workdir, args, roles)
        try:
            time.sleep(1.0)
            fresh = {role: rss_bytes(node) for role, node in nodes.items()}
            samples: dict[str, list[int]] = {role: [] for role in nodes}
            ok = asyncio.run(drive(nodes, workdir, samples))
            time.sleep(args.after_s)
            after = {role: rss_bytes(node) for role, node in nodes.items()}
        finally:
            for node in nodes.values():
                node.stop()
    for role in nodes:
        peak = max(samples[role], default=0)
        print(f"{role:8} {fresh[role] / MIB:10.0f} {peak / MIB:14.0f} {after[role] / MIB:10.0f}"
              f" {ok:4d}", flush=True)

if __name__ == "__main__":
    main()
