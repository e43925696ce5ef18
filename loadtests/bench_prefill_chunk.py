"""What the prefill chunk size costs and buys with the exact prefix cache.

The exact prefix cache reuses whole chunks only (docs/prefix-cache.md), so a
chat turn recomputes the previous turn's partial chunk plus its new tokens:
smaller chunks recompute less, but every prefill runs more, smaller forwards.
For each chunk size this prints, in one process on one model, the median of
``--repeats`` runs of:

* ``cold_s``: a whole prompt of ``--prompt-tokens`` with nothing cached;
* ``turn_s``: the next turn — that prompt plus ``--new-tokens`` — after the
  first prompt's chunks were cached (what a chat's turn 2 costs);
* ``recomputed``: the tokens that turn prefilled.

    python loadtests/bench_prefill_chunk.py [--model DIR] [--chunks 64,128,256,512]
        [--prompt-tokens 1300] [--new-tokens 60] [--repeats 3] [--json PATH]

Every size must give the same logits with and without the cache (it checks).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from bench_common import bench_result, table, write_json
from mlx_lm.models.cache import make_prompt_cache

from engines.model_loader import load_mlx_model
from engines.model_store import ensure_default_model
from engines.prefill import run_prefill
from engines.prefix.cache import PrefixCache


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="mlx-lm checkpoint (default: the embedded SmolLM2)")
    parser.add_argument("--chunks", default="64,128,256,512")
    parser.add_argument("--prompt-tokens", type=int, default=1300)
    parser.add_argument("--new-tokens", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    return parser.parse_args(argv)


def timed_prefill(model, tokens, caches, chunk: int) -> tuple[float, np.ndarray]:
    started = time.perf_counter()
    logits = run_prefill(model, tokens, caches, chunk)
    return time.perf_counter() - started, np.array(logits.astype(mx.float32))


def measure(model, chunk: int, first: tuple[int, ...], turn: tuple[int, ...]) -> dict:
    cold_s, _ = timed_prefill(model, first, make_prompt_cache(model), chunk)
    cache = PrefixCache(1 << 34, chunk)
    cache.store_prompt(first, run_and_keep(model, first, chunk))
    hit = cache.lookup(turn)
    turn_s, cached_logits = timed_prefill(model, turn, hit.caches, chunk)
    _, plain_logits = timed_prefill(model, turn, make_prompt_cache(model), chunk)
    if not np.array_equal(cached_logits, plain_logits):
        raise SystemExit(f"chunk {chunk}: a cache hit changed the logits")
    return {"cold_s": cold_s, "turn_s": turn_s, "recomputed": len(turn) - hit.reused_tokens}


def run_and_keep(model, tokens, chunk: int) -> list:
    caches = make_prompt_cache(model)
    run_prefill(model, tokens, caches, chunk)
    return caches


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    model, config = load_mlx_model(args.model or ensure_default_model())
    rng = np.random.default_rng(0)
    vocab = int(config["vocab_size"])
    first = tuple(int(t) for t in rng.integers(3, vocab, args.prompt_tokens))
    turn = first + tuple(int(t) for t in rng.integers(3, vocab, args.new_tokens))
    rows = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        runs = [measure(model, chunk, first, turn) for _ in range(args.repeats)]
        cold = statistics.median(r["cold_s"] for r in runs)
        turn_s = statistics.median(r["turn_s"] for r in runs)
        rows.append([chunk, round(cold, 3), round(turn_s, 3), runs[0]["recomputed"]])
        print(f"chunk {chunk}: cold {cold:.3f} s, next turn {turn_s:.3f} s "
              f"({runs[0]['recomputed']} tokens recomputed)", flush=True)
    result = bench_result("prefill_chunk", [
        table("prefill chunk size", ["chunk", "cold_s", "turn_s", "recomputed"], rows),
    ])
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
