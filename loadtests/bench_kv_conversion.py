"""How often a KV dtype cast in a handoff changes the text (issue 34: docs/compatibility.md).

A float32 prefill node hands its K/V to a float16 (or bfloat16) decode node of
the same model (the weights cast, same ``config.json``): the prefill node casts
the K/V before sending. Per prompt (``loadtests/prompts.py``, seeded), greedy,
``--tokens`` tokens through ``/v1/completions``: the cluster's text against a
float32 hybrid node's (what the prefill node alone would say) and against a
hybrid node in the decode node's dtype (what the decode node alone would say).
A flip is any difference in the text. Real processes on 127.0.0.1.

    .venv/bin/python loadtests/bench_kv_conversion.py --prompts 40
    .venv/bin/python loadtests/bench_kv_conversion.py --model smollm2 --prompts 40
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "loadtests"))

from prompts import make_prompt  # noqa: E402

from engines.model_store import ensure_default_model  # noqa: E402
from mlxcel_plugin.local_cluster import NodeProcess, start_node  # noqa: E402
from tests.conftest import model_cache_root  # noqa: E402
from tests.integration.test_kv_conversion_cluster import (  # noqa: E402
    MODEL,
    SLOW_STARTUP_S,
    Pair,
    dtype_copy,
    tiny_model,
)


def texts(url: str, prompts: list[str], tokens: int) -> list[str]:
    out = []
    with httpx.Client(timeout=600) as http:
        for prompt in prompts:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0}
            reply = http.post(f"{url}/v1/completions", json=body)
            reply.raise_for_status()
            out.append(reply.json()["choices"][0]["text"])
    return out


def hybrid_texts(workdir: Path, model: Path, prompts: list[str], tokens: int) -> list[str]:
    workdir.mkdir(parents=True, exist_ok=True)
    node: NodeProcess = start_node("hybrid", workdir, ["--model", str(model), "--no-warmup",
                                                       "--served-model-name", MODEL])
    try:
        node.wait_healthy(SLOW_STARTUP_S)  # float16 on a CPU starts slowly
        return texts(node.url, prompts, tokens)
    finally:
        node.stop()


def cluster_texts(workdir: Path, prefill: Path, decode: Path, prompts: list[str],
                  tokens: int) -> list[str]:
    pair = Pair(workdir, startup_s=SLOW_STARTUP_S)
    try:
        _, _, router = pair.start(prefill, decode)
        return texts(router.url, prompts, tokens)
    finally:
        pair.stop()


def flips(got: list[str], want: list[str]) -> str:
    differ = sum(a != b for a, b in zip(got, want, strict=True))
    return f"{differ}/{len(want)} ({100 * differ / len(want):.0f}%)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = tiny_model() if args.model == "tiny" else ensure_default_model(model_cache_root())
    rng = random.Random(args.seed)
    prompts = [make_prompt("short", rng).text() for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory(prefix="bench-kv-conversion-") as tmp:
        work = Path(tmp)
        reference = hybrid_texts(work / "hybrid-float32", model, prompts, args.tokens)
        print(f"model {model.name}, {len(prompts)} prompts, greedy, {args.tokens} tokens")
        print("decode dtype | flips vs float32 hybrid | flips vs hybrid in that dtype")
        for dtype in args.dtypes.split(","):
            narrow = dtype_copy(model, model_cache_root() / f"{model.name}-{dtype}", dtype)
            alone = hybrid_texts(work / f"hybrid-{dtype}", narrow, prompts, args.tokens)
            routed = cluster_texts(work / f"cluster-{dtype}", model, narrow, prompts,
                                   args.tokens)
            print(f"{dtype:12} | {flips(routed, reference):23} | {flips(routed, alone)}")
            print(f"{'':12} | (hybrid {dtype} vs float32 hybrid: {flips(alone, reference)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
