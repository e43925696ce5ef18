"""Prompt-lookup speculation against plain decoding: ``python -m loadtests.bench_speculative``.

For two workloads, on one engine with ``[speculative] method = "ngram"`` and one
without (the same checkpoint, in this process):

* **code edit**: a generated Python file in the prompt, the reply asked to be the
  same file with one rename (the reply repeats long spans of the prompt);
* **open chat**: short questions (little to look up: the adaptive rule's case).

Figures: per-stream decode tokens/s (first token excluded) at 1 and 4 concurrent
streams, plain and n-gram; acceptance (accepted / proposed); the **flip rate**
(how many greedy replies differ from plain greedy decoding at all, and where the
first difference falls); and the cost of one more verified row (a forward of
1 + k rows against a one-row step), which ``[speculative] verify_row_cost`` sets.

Defaults to the embedded SmolLM2-135M (``--quick``: the tiny test model, few
prompts). Runs with OpenBLAS preloaded as the nodes do; CPU-bound: run it alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

from engines.mlx_engine import MlxEngine
from engines.model_store import ensure_default_model, ensure_tiny_model
from loadtests.bench_common import add_common_args, bench_result, format_table, table, write_json
from loadtests.speculative_workloads import chat_prompts, code_edit_prompts, verify_row_cost
from mlxcel_plugin import openblas
from mlxcel_plugin.engine_api import (
    EngineConfig,
    GenerationRequest,
    PrefixCacheConfig,
    TokenEvent,
)
from mlxcel_plugin.speculative.settings import SpeculativeConfig


@dataclass
class Reply:
    """One request's tokens and when each arrived."""

    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None

    def __call__(self, event: TokenEvent) -> None:
        if event.token_id is not None:
            self.tokens.append(event.token_id)
            self.times.append(time.perf_counter())
        if event.finish_reason is not None:
            self.error = event.error
            self.done.set()

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first over the time since the first (the decode phase)."""
        span = self.times[-1] - self.times[0] if len(self.times) > 1 else 0.0
        return (len(self.times) - 1) / span if span > 0 else 0.0


def run_concurrently(engine: MlxEngine, prompts: list[tuple[int, ...]], max_tokens: int,
                     streams: int, tag: str) -> list[Reply]:
    """Every prompt, ``streams`` at a time (a wave waits for its slowest)."""
    replies: list[Reply] = []
    for start in range(0, len(prompts), streams):
        wave = [Reply() for _ in prompts[start : start + streams]]
        for i, reply in enumerate(wave):
            request = GenerationRequest(f"{tag}-{start + i}", prompts[start + i], max_tokens)
            engine.generate(request, reply)
        for reply in wave:
            if not reply.done.wait(900):
                raise TimeoutError(f"{tag}: no reply in 900 s")
            if reply.error:
                raise RuntimeError(f"{tag}: {reply.error}")
        replies += wave
    return replies


def ngram_counts(engine: MlxEngine) -> tuple[int, int]:
    counts = engine.stats().speculative.methods.get("ngram")
    return (counts.proposed, counts.accepted) if counts else (0, 0)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token that differs (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class WorkloadFigures:
    rows: list[list] = field(default_factory=list)
    flips: list[int | None] = field(default_factory=list)  # first difference per prompt


def measure(engines: dict[str, MlxEngine], name: str, prompts: list[tuple[int, ...]],
            max_tokens: int, concurrency: list[int], figures: WorkloadFigures) -> None:
    """Plain and n-gram at each concurrency: tok/s, acceptance; flips from the first one."""
    for streams in concurrency:
        outputs = {}
        for mode, engine in engines.items():
            before = ngram_counts(engine)
            replies = run_concurrently(engine, prompts, max_tokens, streams, f"{name}{streams}")
            proposed, accepted = (n - b for n, b in zip(ngram_counts(engine), before, strict=True))
            outputs[mode] = [r.tokens for r in replies]
            rate = f"{accepted / proposed:.0%}" if proposed else "-"
            figures.rows.append([name, streams, mode, round(statistics.median(
                r.decode_tok_s for r in replies), 1), proposed, rate])
            print("  ", *figures.rows[-1], flush=True)
        if streams == concurrency[0]:
            figures.flips = [first_difference(p, s) for p, s in zip(outputs["plain"],
                                                                   outputs["ngram"], strict=True)]
            print(f"   {name}: first differences from plain greedy {figures.flips}", flush=True)


def load_engines(model: str) -> dict[str, MlxEngine]:
    no_cache = PrefixCacheConfig(max_bytes=0)  # every request prefills: runs stay comparable
    engines = {
        "plain": MlxEngine.from_path(model, EngineConfig(prefix_cache=no_cache)),
        "ngram": MlxEngine.from_path(model, EngineConfig(
            prefix_cache=no_cache, speculative=SpeculativeConfig(method="ngram"))),
    }
    for engine in engines.values():
        engine.start()
    return engines


def report(rows: list[list], flips: dict[str, list[int | None]], cost: dict[int, float]) -> list:
    tables = [table("decode tokens/s per stream (median)",
                    ["workload", "streams", "mode", "tok/s", "proposed", "accepted"], rows)]
    flip_rows = []
    for name, found in flips.items():
        flipped = [i for i in found if i is not None]
        where = ", ".join(str(i) for i in sorted(flipped)) or "-"
        flip_rows.append([name, len(found), len(flipped), f"{len(flipped) / len(found):.0%}",
                          where])
    tables.append(table("greedy flips vs plain (first concurrency)",
                        ["workload", "prompts", "differ", "rate", "first difference at"],
                        flip_rows))
    tables.append(table("verify forward cost (one sequence)", ["rows", "time / one-row step",
                                                                "per extra row"],
                        [[w, round(c, 3), round((c - 1) / (w - 1), 3) if w > 1 else "-"]
                         for w, c in cost.items()]))
    for result_table in tables:
        print(format_table(result_table))
    return tables


def main() -> None:
    env = openblas.preload_env(os.environ)  # as the nodes run: MLX's own CPU BLAS is slow
    if env is not None:
        changed = {k: env[k] for k in ("LD_PRELOAD", "OPENBLAS_CORETYPE")
                   if env.get(k) != os.environ.get(k)}
        print(f"re-running with {changed} (as the nodes run)", flush=True)
        os.execve(sys.executable, [sys.executable, "-m", "loadtests.bench_speculative",
                                   *sys.argv[1:]], env)
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--code-prompts", type=int, help="default 8 (--quick: 4)")
    parser.add_argument("--chat-prompts", type=int, help="default 24 (--quick: 4)")
    parser.add_argument("--max-tokens", type=int, help="default 192 (--quick: 48)")
    parser.add_argument("--streams", default="1,4", help="concurrent streams to run, e.g. 1")
    args = parser.parse_args()
    defaults = (4, 4, 48) if args.quick else (8, 24, 192)
    args.code_prompts, args.chat_prompts, args.max_tokens = (
        given if given is not None else default for given, default in
        zip((args.code_prompts, args.chat_prompts, args.max_tokens), defaults, strict=True))
    model = args.model or str(ensure_tiny_model() if args.quick else ensure_default_model())
    print(f"model {model}", flush=True)
    engines = load_engines(model)
    try:
        tokenizer_dir = engines["plain"].info.tokenizer_dir or model
        workloads = {"code-edit": code_edit_prompts(tokenizer_dir, args.code_prompts),
                     "open-chat": chat_prompts(tokenizer_dir, args.chat_prompts)}
        figures = {name: WorkloadFigures() for name in workloads}
        for name, prompts in workloads.items():
            print(f"{name}: {len(prompts)} prompts, {args.max_tokens} tokens each", flush=True)
            measure(engines, name, prompts, args.max_tokens,
                    [int(n) for n in args.streams.split(",")], figures[name])
    finally:
        for engine in engines.values():
            engine.close()
    cost = verify_row_cost(model)
    rows = [row for f in figures.values() for row in f.rows]
    tables = report(rows, {name: f.flips for name, f in figures.items()}, cost)
    if args.json:
        write_json(args.json, bench_result("speculative", tables))


if __name__ == "__main__":
    main()
