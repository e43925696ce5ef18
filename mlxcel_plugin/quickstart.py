"""The README's main job: a local router + prefill + decode cluster answering a request.

``python -m mlxcel_plugin.quickstart`` starts the three processes on the
embedded default model (generating a cluster secret), asks one chat question
through the router, prints the answer, and stops — or keeps serving with
``--serve`` until Ctrl-C or SIGTERM. Either signal stops the three nodes
(each drains: in-flight requests finish) and waits for them before exiting.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import urllib.request
from pathlib import Path

from mlxcel_plugin.local_cluster import LocalCluster

QUESTION = "What is the capital of France?"


def ask(base_url: str, model: str, question: str, max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def served_model(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as response:
        return json.loads(response.read())["data"][0]["id"]


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM as Ctrl-C: unwinds into the cluster's ``with``, which stops the nodes."""
    raise KeyboardInterrupt


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        run(sys.argv[1:])
    except KeyboardInterrupt:
        print("stopped: the nodes drained and exited", flush=True)


def run(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="quickstart", description=__doc__)
    parser.add_argument("--port", type=int, default=8080, help="router HTTP port")
    parser.add_argument("--model", help="checkpoint dir (default: embedded SmolLM2)")
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--serve", action="store_true", help="keep serving after the demo")
    parser.add_argument("--workdir", default=".cache/quickstart", help="logs and cluster.secret")
    args = parser.parse_args(argv)

    cluster = LocalCluster(Path(args.workdir), model=args.model, router_port=args.port)
    print("starting router + prefill + decode on 127.0.0.1 ...", flush=True)
    started = time.monotonic()
    with cluster:
        base_url = cluster.router.url
        print(f"cluster up in {time.monotonic() - started:.1f}s; router at {base_url}")
        for node in cluster.nodes:
            print(f"  {node.role:<8} http://127.0.0.1:{node.port}  link {node.serving_bind or '-'}")
        print(f"\nQ: {args.question}")
        model = served_model(base_url)
        reply = ask(base_url, model, args.question, args.max_tokens)
        print(f"A: {reply['choices'][0]['message']['content'].strip()}")
        print(f"usage: {reply['usage']}  model: {model}")
        if args.serve:
            print(f"\nserving at {base_url}/v1 — Ctrl-C to stop")
            while all(node.process.poll() is None for node in cluster.nodes):
                time.sleep(1.0)


if __name__ == "__main__":
    main()
