"""Per KV codec on the real SmolLM2: size ratio, codec MB/s, greedy token agreement.

For each prompt the engine prefills once; the cache then goes through every
codec (``transcode_cache``: KVWriter → KVAssembler, what a decode node would
hold) and all variants decode greedily *in one batch* together with the
untouched cache (the reference). They are submitted from the prefill's
``on_done`` callback, on the engine thread, so they join the batch in the same
step: every row sees the same kernel shapes (with OpenBLAS the numbers vary
~1e-6 with the batch shape; codec ``none`` is the control and must agree 100%).

Agreement per codec, pooled over prompts: *prefix* = tokens before the first
divergence / tokens compared; *overall* = position-wise matches / tokens
compared (compared = the longer of the two runs; EOS may end a run early).
Size ratio and MB/s are measured on the writer's 4 MiB chunks of the real
caches, as held (float32: the checkpoint's dtype) and cast to float16 (what a
half-precision model would ship).

Usage: python loadtests/bench_kv_agreement.py [--quick] [--json PATH] [--prompts 10]
       [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from bench_common import add_common_args, bench_result, table, write_json
from bench_kv_codecs import chunks_of, codec_figures, transcode_cache
from prompts import make_prompt

from mlxcel_plugin import openblas
from mlxcel_plugin.builtin_plugin import builtin_codecs
from mlxcel_plugin.engine_api import (
    CacheLayer,
    CacheState,
    EngineConfig,
    GenerationRequest,
    PrefillResult,
    TokenEvent,
)
from mlxcel_plugin.kv_codecs import resolve_codec
from mlxcel_plugin.kv_serde import ModelFingerprint

CODEC_NAMES = ("none", "lz4", "shuffle+lz4", "int8", "int8+lz4", "int4")
CODECS = builtin_codecs()
REFERENCE = "reference"
WAIT_S = 900.0
CHUNK_BYTES = 4 << 20


def reexec_with_openblas() -> None:
    """MLX's CPU wheel ships a slow BLAS; preloading OpenBLAS needs a fresh process."""
    env = openblas.preload_env(os.environ)
    if env is not None:
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


@dataclass
class Collector:
    """Token events of several sequences (engine thread) until all have finished."""

    expected: int
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    def emit(self, event: TokenEvent) -> None:
        if event.token_id is not None:
            self.tokens.setdefault(event.request_id, []).append(event.token_id)
        if event.finish_reason is not None:
            self.finished += 1
            if self.finished == self.expected:
                self.done.set()


@dataclass
class PromptRun:
    result: PrefillResult | None = None
    variants: dict[str, list[int]] = field(default_factory=dict)


def run_prompt(
    engine: Any,
    fingerprint: ModelFingerprint,
    prompt_id: int,
    tokens: Sequence[int],
    max_tokens: int,
) -> PromptRun:
    """Prefill once; decode the reference and every codec's cache in one batch."""
    names = (REFERENCE, *CODEC_NAMES)
    collector = Collector(expected=len(names))
    run = PromptRun()
    base = GenerationRequest(f"p{prompt_id}", tuple(tokens), max_tokens)

    def on_done(result: PrefillResult | Exception) -> None:
        # On the engine thread: every decode is queued before the engine's next loop.
        if isinstance(result, Exception):
            collector.done.set()
            raise result
        run.result = result
        for name in names:
            cache = (
                result.cache
                if name == REFERENCE
                else transcode_cache(result.cache, fingerprint, name)
            )
            request = GenerationRequest(f"p{prompt_id}/{name}", base.prompt_tokens, max_tokens)
            collector.emit(TokenEvent(request.request_id, 0, result.first_token))
            engine.decode(request, result.first_token, cache, collector.emit)

    engine.prefill(base, on_done)
    if not collector.done.wait(WAIT_S) or run.result is None:
        raise TimeoutError(f"prompt {prompt_id}: prefill or decode did not finish")
    run.variants = {name: collector.tokens[f"p{prompt_id}/{name}"] for name in names}
    return run


def compare(reference: list[int], other: list[int]) -> tuple[int, int, int]:
    """(prefix matches, overall matches, compared) of two greedy runs."""
    compared = max(len(reference), len(other))
    same = [a == b for a, b in zip(reference, other, strict=False)]
    prefix = same.index(False) if False in same else len(same)
    return prefix, sum(same), compared


def agreement_rows(runs: list[PromptRun]) -> tuple[list[list[Any]], dict[str, float]]:
    rows, overall_by_codec = [], {}
    for name in CODEC_NAMES:
        totals = np.zeros(3, dtype=np.int64)
        identical = 0
        for run in runs:
            counts = compare(run.variants[REFERENCE], run.variants[name])
            totals += counts
            identical += counts[0] == counts[2]
        prefix, overall, compared = (int(x) for x in totals)
        overall_by_codec[name] = overall / compared
        rows.append(
            [
                name,
                compared,
                round(100 * prefix / compared, 1),
                round(100 * overall / compared, 1),
                f"{identical}/{len(runs)}",
            ]
        )
    return rows, overall_by_codec


def cast_cache(cache: CacheState, dtype: str) -> CacheState:
    layers = [
        CacheLayer(
            layer.kind,
            layer.keys.astype(dtype),
            layer.values.astype(dtype),
            dtype,
            layer.offset,
            dict(layer.meta),
        )
        for layer in cache.layers
    ]
    return CacheState(layers)


def codec_rows(
    caches: list[CacheState], fingerprint: ModelFingerprint, repeats: int
) -> list[list[Any]]:
    """Ratio and MB/s per codec over the real caches, as held and cast to float16."""
    rows = []
    for dtype in (fingerprint.dtype, "float16"):
        chunks = [
            chunk
            for cache in caches
            for chunk in chunks_of(
                cast_cache(cache, dtype) if dtype != fingerprint.dtype else cache,
                fingerprint.head_dim,
                CHUNK_BYTES,
            )
        ]
        for name in CODEC_NAMES:
            fig = codec_figures(resolve_codec(name, CODECS), chunks, dtype, repeats)
            rows.append(
                [
                    dtype,
                    name,
                    round(fig["ratio"], 3),
                    round(fig["encode_mb_s"]),
                    round(fig["decode_mb_s"]),
                    f"{fig['max_rel_error']:.4f}",
                ]
            )
            print("codec", rows[-1], flush=True)
    return rows


def load_prompts(model_path: str, count: int) -> list[list[int]]:
    """Chat prompts from the load-test mix (short questions and document tasks)."""
    from mlxcel_plugin.text import TextTokenizer

    tokenizer = TextTokenizer.from_dir(model_path)
    rng = random.Random(7)
    kinds = ["short", "medium", "short", "long", "medium"]
    prompts = []
    for i in range(count):
        prompt = make_prompt(kinds[i % len(kinds)], rng)
        prompts.append(tokenizer.encode_chat(tokenizer.render_chat(prompt.messages())))
    return prompts


def main() -> None:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per run")
    parser.add_argument("--repeats", type=int, default=3, help="codec timing repeats")
    args = parser.parse_args()
    reexec_with_openblas()
    from engines.model_store import ensure_default_model
    from engines.plugin import make_mlx_engine

    count = 2 if args.quick else args.prompts
    max_tokens = 16 if args.quick else args.tokens
    model_path = str(ensure_default_model())
    engine = make_mlx_engine(model_path, EngineConfig())
    engine.start()
    fingerprint = ModelFingerprint.from_dict(engine.info.fingerprint)
    runs = []
    try:
        for i, tokens in enumerate(load_prompts(model_path, count)):
            start = time.perf_counter()
            runs.append(run_prompt(engine, fingerprint, i, tokens, max_tokens))
            print(
                f"prompt {i}: {len(tokens)} tokens, {time.perf_counter() - start:.1f}s, "
                + " ".join(
                    f"{n}={compare(runs[-1].variants[REFERENCE], runs[-1].variants[n])}"
                    for n in CODEC_NAMES
                ),
                flush=True,
            )
    finally:
        engine.close()
    rows, overall = agreement_rows(runs)
    for row in rows:
        print("agreement", row, flush=True)
    sizes = codec_rows(
        [run.result.cache for run in runs], fingerprint, 1 if args.quick else args.repeats
    )
    tables = [
        table(
            f"Greedy agreement vs the uncompressed cache, SmolLM2-135M fp32, {count} prompts x "
            f"{max_tokens} tokens (one batch per prompt)",
            ["codec", "tokens compared", "prefix %", "overall %", "identical runs"],
            rows,
        ),
        table(
            "Codecs on the real caches (4 MiB chunks; MB/s of raw bytes)",
            ["dtype", "codec", "ratio", "encode MB/s", "decode MB/s", "max rel err"],
            sizes,
        ),
    ]
    series = {f"agreement_{name}": [value] for name, value in overall.items()}
    if args.json:
        write_json(args.json, bench_result("kv_agreement", tables, series))


if __name__ == "__main__":
    main()
