"""Speculative decoding against plain decoding: ``python -m loadtests.bench_speculative``.

For three workloads, on engines of the same checkpoint in this process: plain,
``[speculative] method = "ngram"`` and ``method = "draft"`` (``--draft PATH``; by
default the model drafts for itself: acceptance near 100%, an upper bound):

* **code edit**: a generated Python file in the prompt, the reply asked to be the
  same file with one rename (the reply repeats long spans of the prompt);
* **tool call**: an agent turn whose reply repeats a tool call's JSON arguments;
* **open chat**: short questions (little to look up: the adaptive rule's case).

Figures: per-stream decode tokens/s (first token excluded) at each concurrency
(``--streams``), per mode; acceptance (accepted / proposed); the **flip rate** (how
many greedy replies differ from plain greedy decoding at all, and where the first
difference falls); the cost of one more verified row (``verify_row_cost``); a
draft's prefill of a 2k prompt (what a decode node spends instead of receiving the
draft's K/V). ``--mlx-lm``: ``mlx_lm server --draft-model`` on the same prompts.

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
from loadtests.bench_speculative_mlx_lm import mlx_lm_rows
from loadtests.speculative_workloads import (
    chat_prompts,
    code_edit_prompts,
    draft_prefill_s,
    tool_call_prompts,
    verify_row_cost,
)
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


def run_wave(engine: MlxEngine, prompts: list[tuple[int, ...]], max_tokens: int,
             tag: str) -> list[Reply]:
    """The prompts at once (one per stream); waits for every reply."""
    wave = [Reply() for _ in prompts]
    for i, (prompt, reply) in enumerate(zip(prompts, wave, strict=True)):
        engine.generate(GenerationRequest(f"{tag}-{i}", prompt, max_tokens), reply)
    for reply in wave:
        if not reply.done.wait(900):
            raise TimeoutError(f"{tag}: no reply in 900 s")
        if reply.error:
            raise RuntimeError(f"{tag}: {reply.error}")
    return wave


def run_interleaved(engines: dict[str, MlxEngine], prompts: list[tuple[int, ...]],
                    max_tokens: int, streams: int, tag: str) -> dict[str, list[Reply]]:
    """Every prompt on every engine, ``streams`` at a time, the modes taking turns wave by
    wave (in alternating order), so a machine whose load drifts slows each mode alike."""
    replies: dict[str, list[Reply]] = {mode: [] for mode in engines}
    for number, start in enumerate(range(0, len(prompts), streams)):
        order = list(engines) if number % 2 == 0 else list(reversed(engines))
        for mode in order:
            replies[mode] += run_wave(engines[mode], prompts[start : start + streams],
                                      max_tokens, f"{tag}-{mode}-{start}")
    return replies


def method_counts(engine: MlxEngine, method: str) -> tuple[int, int]:
    counts = engine.stats().speculative.methods.get(method)
    return (counts.proposed, counts.accepted) if counts else (0, 0)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token that differs (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def paired_ratio(replies: list[Reply], plain: list[Reply]) -> float:
    """Median over prompts of this mode's tok/s over plain's on the same prompt (same wave
    slot: the load both ran under is as alike as this machine allows)."""
    ratios = [r.decode_tok_s / p.decode_tok_s for r, p in zip(replies, plain, strict=True)
              if p.decode_tok_s > 0]
    return round(statistics.median(ratios), 2) if ratios else 0.0


@dataclass
class WorkloadFigures:
    rows: list[list] = field(default_factory=list)
    # Per speculative mode, the first difference from plain greedy per prompt.
    flips: dict[str, list[int | None]] = field(default_factory=dict)


def measure(engines: dict[str, MlxEngine], name: str, prompts: list[tuple[int, ...]],
            max_tokens: int, concurrency: list[int], figures: WorkloadFigures) -> None:
    """Every mode at each concurrency: tok/s, acceptance; flips from the first one."""
    for streams in concurrency:
        before = {mode: method_counts(engine, mode) for mode, engine in engines.items()}
        replies = run_interleaved(engines, prompts, max_tokens, streams, f"{name}{streams}")
        outputs = {mode: [r.tokens for r in found] for mode, found in replies.items()}
        for mode, engine in engines.items():
            proposed, accepted = (n - b for n, b in zip(method_counts(engine, mode),
                                                        before[mode], strict=True))
            rate = f"{accepted / proposed:.0%}" if proposed else "-"
            figures.rows.append([name, streams, mode, round(statistics.median(
                r.decode_tok_s for r in replies[mode]), 2), proposed, rate,
                paired_ratio(replies[mode], replies["plain"])])
            print("  ", *figures.rows[-1], flush=True)
        if streams == concurrency[0]:
            for mode in [m for m in outputs if m != "plain"]:
                figures.flips[mode] = [first_difference(p, s) for p, s in zip(
                    outputs["plain"], outputs[mode], strict=True)]
                print(f"   {name} {mode}: first differences from plain greedy "
                      f"{figures.flips[mode]}", flush=True)


def load_engines(model: str, draft: str, modes: list[str]) -> dict[str, MlxEngine]:
    no_cache = PrefixCacheConfig(max_bytes=0)  # every request prefills: runs stay comparable
    configs = {"plain": SpeculativeConfig(), "ngram": SpeculativeConfig(method="ngram"),
               "draft": SpeculativeConfig(method="draft", draft_model=draft)}
    engines = {mode: MlxEngine.from_path(model, EngineConfig(
        prefix_cache=no_cache, speculative=configs[mode])) for mode in ["plain", *modes]}
    for engine in engines.values():
        engine.start()
    return engines


def flip_rows(flips: dict[str, dict[str, list[int | None]]]) -> list[list]:
    """Per workload and mode (and all workloads): replies that differ from plain greedy."""
    rows, totals = [], {}
    for name, per_mode in flips.items():
        for mode, found in per_mode.items():
            flipped = [i for i in found if i is not None]
            seen, differ = totals.get(mode, (0, 0))
            totals[mode] = (seen + len(found), differ + len(flipped))
            rows.append([name, mode, len(found), len(flipped),
                         f"{len(flipped) / len(found):.0%}",
                         ", ".join(str(i) for i in sorted(flipped)) or "-"])
    rows += [["all", mode, seen, differ, f"{differ / seen:.0%}", ""]
             for mode, (seen, differ) in totals.items()]
    return rows


def report(rows: list[list], flips: dict[str, dict[str, list[int | None]]],
           cost: dict[int, float], prefill: tuple[float, int] | None) -> list:
    tables = [table("decode tokens/s per stream (median)",
                    ["workload", "streams", "mode", "tok/s", "proposed", "accepted",
                     "x plain (paired)"], rows)]
    tables.append(table("greedy flips vs plain (first concurrency)",
                        ["workload", "mode", "prompts", "differ", "rate", "first difference at"],
                        flip_rows(flips)))
    if prefill is not None:
        tables.append(table("draft prefill of a 2048-token prompt (decode node)",
                            ["seconds", "draft K/V MiB"],
                            [[round(prefill[0], 3), round(prefill[1] / 2**20, 1)]]))
    tables.append(table("verify forward cost (one sequence)", ["rows", "time / one-row step",
                                                                "per extra row"],
                        [[w, round(c, 3), round((c - 1) / (w - 1), 3) if w > 1 else "-"]
                         for w, c in cost.items()]))
    for result_table in tables:
        print(format_table(result_table))
    return tables


def parse_args() -> argparse.Namespace:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--draft", help="draft checkpoint (default: the model itself)")
    parser.add_argument("--modes", default="ngram,draft", help="beside plain, e.g. ngram")
    parser.add_argument("--code-prompts", type=int, help="default 8 (--quick: 4)")
    parser.add_argument("--tool-prompts", type=int, help="default 8 (--quick: 4)")
    parser.add_argument("--chat-prompts", type=int, help="default 16 (--quick: 4)")
    parser.add_argument("--max-tokens", type=int, help="default 192 (--quick: 48)")
    parser.add_argument("--streams", default="1,4", help="concurrent streams to run, e.g. 1")
    parser.add_argument("--no-draft-prefill", action="store_true",
                        help="skip the draft's 2k-token prefill probe (minutes on SmolLM2)")
    parser.add_argument("--mlx-lm", action="store_true",
                        help="also mlx_lm server --draft-model on the same prompts")
    args = parser.parse_args()
    defaults = (4, 4, 4, 48) if args.quick else (8, 8, 16, 192)
    names = ("code_prompts", "tool_prompts", "chat_prompts", "max_tokens")
    for name, default in zip(names, defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def workloads(tokenizer_dir: str, args: argparse.Namespace) -> dict[str, list[tuple[int, ...]]]:
    found = {"code-edit": code_edit_prompts(tokenizer_dir, args.code_prompts),
             "tool-call": tool_call_prompts(tokenizer_dir, args.tool_prompts),
             "open-chat": chat_prompts(tokenizer_dir, args.chat_prompts)}
    return {name: prompts for name, prompts in found.items() if prompts}


def main() -> None:
    env = openblas.preload_env(os.environ)  # as the nodes run: MLX's own CPU BLAS is slow
    if env is not None:
        changed = {k: env[k] for k in ("LD_PRELOAD", "OPENBLAS_CORETYPE")
                   if env.get(k) != os.environ.get(k)}
        print(f"re-running with {changed} (as the nodes run)", flush=True)
        os.execve(sys.executable, [sys.executable, "-m", "loadtests.bench_speculative",
                                   *sys.argv[1:]], env)
    args = parse_args()
    model = args.model or str(ensure_tiny_model() if args.quick else ensure_default_model())
    draft, streams = args.draft or model, [int(n) for n in args.streams.split(",")]
    print(f"model {model}, draft {draft}", flush=True)
    engines = load_engines(model, draft, [m for m in args.modes.split(",") if m])
    try:
        prompts = workloads(engines["plain"].info.tokenizer_dir or model, args)
        figures = {name: WorkloadFigures() for name in prompts}
        for name, batch in prompts.items():
            print(f"{name}: {len(batch)} prompts, {args.max_tokens} tokens each", flush=True)
            measure(engines, name, batch, args.max_tokens, streams, figures[name])
    finally:
        for engine in engines.values():
            engine.close()
    rows = [row for f in figures.values() for row in f.rows]
    if args.mlx_lm:
        rows += mlx_lm_rows(model, draft, prompts, args.max_tokens, streams)
    tables = report(rows, {name: f.flips for name, f in figures.items()}, verify_row_cost(model),
                    None if args.no_draft_prefill else draft_prefill_s(draft))
    if args.json:
        write_json(args.json, bench_result("speculative", tables))


if __name__ == "__main__":
    main()
