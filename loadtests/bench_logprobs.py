"""What logprobs cost per token: ``python -m loadtests.bench_logprobs [MODEL_DIR]``.

1. The computation alone (``mlxcel_plugin.logprobs.token_logprobs``) on one
   float32 row of the model's vocabulary, for ``top`` 0, 5 and 20.
2. The engine: ``--batch`` greedy requests of ``--tokens`` tokens decoded
   together, without logprobs and with ``logprobs`` = 0, 5, 20, in alternating
   rounds (median of ``--rounds``): the added time per generated token.
3. Prompt logprobs: a ``--prompt``-token prefill with and without them.

Defaults to the tiny checkpoint (SmolLM2's 49152-token vocabulary, which sets
the cost; the model's own step time does not), with OpenBLAS preloaded as
the nodes run. CPU-bound: run it alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import threading
import time

import numpy as np

from engines.mlx_engine import MlxEngine
from engines.model_store import ensure_tiny_model
from mlxcel_plugin import openblas
from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest, SamplingParams, TokenEvent
from mlxcel_plugin.logprobs import token_logprobs

TOPS = (None, 0, 5, 20)


def micro_us(vocab: int, top: int, repeats: int = 300) -> float:
    row = np.random.default_rng(0).standard_normal(vocab).astype(np.float32)
    token_logprobs(row, 1, top)  # warm
    start = time.perf_counter()
    for _ in range(repeats):
        token_logprobs(row, 1, top)
    return (time.perf_counter() - start) / repeats * 1e6


def run_batch(engine: MlxEngine, requests: list[GenerationRequest]) -> tuple[float, int]:
    """(seconds, tokens) for requests decoded together."""
    done, counts = threading.Semaphore(0), [0]

    def emit(event: TokenEvent) -> None:
        counts[0] += event.token_id is not None
        if event.finish_reason is not None:
            done.release()

    start = time.perf_counter()
    for request in requests:
        engine.generate(request, emit)
    for _ in requests:
        done.acquire()
    return time.perf_counter() - start, counts[0]


def requests(tag: str, batch: int, prompt: int, tokens: int, params: SamplingParams):
    rng = np.random.default_rng(len(tag))
    return [GenerationRequest(f"{tag}-{i}", tuple(int(t) for t in rng.integers(3, 40000, prompt)),
                              tokens, params) for i in range(batch)]


def decode_overhead(engine: MlxEngine, args: argparse.Namespace) -> dict:
    per_token: dict[int | None, list[float]] = {top: [] for top in TOPS}
    for r in range(args.rounds):
        for top in TOPS:
            params = SamplingParams(logprobs=top)
            seconds, count = run_batch(engine, requests(f"r{r}-{top}", args.batch, 32,
                                                        args.tokens, params))
            per_token[top].append(seconds / count * 1e6)
    return {top: statistics.median(values) for top, values in per_token.items()}


def prefill_overhead(engine: MlxEngine, args: argparse.Namespace) -> tuple[float, float]:
    plain, asked = [], []
    for r in range(args.rounds):
        for target, params in ((plain, SamplingParams()), (asked, SamplingParams(
                logprobs=1, prompt_logprobs=1))):
            batch = requests(f"p{r}-{len(target)}-{id(target)}", 1, args.prompt, 1, params)
            target.append(run_batch(engine, batch)[0] * 1e3)
    return statistics.median(plain), statistics.median(asked)


def main() -> None:
    env = openblas.preload_env(os.environ)  # as the nodes run: MLX's own CPU BLAS is slow
    if env is not None:
        os.execve(sys.executable, [sys.executable, "-m", "loadtests.bench_logprobs",
                                   *sys.argv[1:]], env)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model = args.model or str(ensure_tiny_model())
    engine = MlxEngine.from_path(model, dataclasses.replace(EngineConfig(),
                                                            prefix_cache=dataclasses.replace(
                                                                EngineConfig().prefix_cache,
                                                                max_bytes=0)))
    vocab = engine.info.vocab_size
    print(f"model {model}, vocabulary {vocab}")
    for top in (0, 5, 20):
        print(f"token_logprobs top={top:>2}: {micro_us(vocab, top):7.1f} us per token")
    engine.start()
    try:
        found = decode_overhead(engine, args)
        base = found[None]
        print(f"decode, batch {args.batch}: {base:7.1f} us per token without logprobs")
        for top in TOPS[1:]:
            print(f"  logprobs={top:>2}: {found[top]:7.1f} us per token "
                  f"(+{found[top] - base:.1f} us, {found[top] / base - 1:+.1%})")
        plain_ms, asked_ms = prefill_overhead(engine, args)
        print(f"prefill of {args.prompt} tokens: {plain_ms:.1f} ms, with prompt logprobs "
              f"{asked_ms:.1f} ms ({asked_ms / plain_ms - 1:+.0%})")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
