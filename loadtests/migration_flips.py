"""How often a migration flips a token on a real model (``bench_chaos.py --flips``).

A migrated request is re-prefilled with prompt + the tokens it streamed; those tokens' K/V
then come from a prefill (a chunked matmul) instead of from the decode steps that made them,
so float rounding differs and a near-tie between two tokens can turn the other way. Per
prompt (short and medium mixed, ``loadtests/prompts.py``, seeded): the no-fault output of
``--flip-tokens`` tokens on one in-process engine, then for each migration point ``k``
(``--flip-points``) the output of prompt + its first ``k`` tokens with the budget left
(chat-templated prompts, as the router sends them). A flip is any difference; the figures
are the share of (prompt, k) pairs that flipped and where the first flip came. Greedy and
seeded (temperature 0.8) requests, or greedy alone (``--greedy-only``).
"""

from __future__ import annotations

import argparse
import random
import threading
from pathlib import Path

from bench_common import format_table, table
from prompts import make_prompt

from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest, SamplingParams, TokenEvent

TOKENS = 64
MIGRATION_POINTS = (1, 16, 40)


def generate(engine, request: GenerationRequest) -> list[int]:
    tokens, done = [], threading.Event()

    def emit(event: TokenEvent) -> None:
        if event.token_id is not None:
            tokens.append(event.token_id)
        if event.finish_reason is not None:
            done.set()

    engine.generate(request, emit)
    done.wait(600)
    return tokens


def flips_of(engine, prompt: tuple[int, ...], sampling: SamplingParams, tag: str,
             tokens: int = TOKENS, points: tuple[int, ...] = MIGRATION_POINTS) -> list:
    """[(k, first flipped index or None)] for each migration point of one prompt."""
    whole = generate(engine, GenerationRequest(f"{tag}", prompt, tokens, sampling))
    found = []
    for k in points:
        if k >= len(whole):
            continue  # it ended (EOS) before this point: nothing to migrate
        moved = GenerationRequest(f"{tag}-{k}", prompt + tuple(whole[:k]), tokens - k, sampling)
        rest = generate(engine, moved)
        diffs = [i for i, (a, b) in enumerate(zip(rest, whole[k:], strict=False)) if a != b]
        if not diffs and len(rest) != len(whole) - k:
            diffs = [min(len(rest), len(whole) - k)]
        found.append((k, k + diffs[0] if diffs else None))
    return found


def load_engine(model: str | None):
    from engines.mlx_engine import MlxEngine
    from engines.model_store import ensure_default_model

    path = model or str(ensure_default_model(Path(__file__).resolve().parents[1] / ".cache"
                                             / "mlxcel"))
    engine = MlxEngine.from_path(path, EngineConfig())
    engine.start()
    return engine, path


def run_flips(args: argparse.Namespace) -> int:
    from mlxcel_plugin.text.tokenizer import TextTokenizer

    engine, path = load_engine(args.model)
    tokenizer = TextTokenizer.from_dir(path)
    rng = random.Random(0)
    prompts = [make_prompt("short" if i % 2 else "medium", rng) for i in range(args.prompts)]
    points = tuple(int(k) for k in args.flip_points.split(","))
    modes = [("greedy", SamplingParams()), ("seeded t=0.8", SamplingParams(temperature=0.8,
                                                                          seed=5))]
    rows = []
    try:
        for name, sampling in modes[:1] if args.greedy_only else modes:
            pairs = []
            for i, prompt in enumerate(prompts):
                ids = tokenizer.encode_chat(tokenizer.render_chat(prompt.messages()))
                pairs += flips_of(engine, tuple(ids), sampling, f"{name}-{i}",
                                  args.flip_tokens, points)
                print(f"{name} prompt {i}: {pairs[-len(points):]}", flush=True)
            flipped = [at for _, at in pairs if at is not None]
            rows.append([name, len(prompts), len(pairs), len(flipped),
                         f"{100 * len(flipped) / max(len(pairs), 1):.1f}",
                         sorted(flipped)[:10]])
            print(rows[-1], flush=True)
    finally:
        engine.close()
    print(format_table(table(f"migration flips, {Path(path).name}, {args.flip_tokens} tokens, "
                             f"points {points}",
                             ["sampling", "prompts", "pairs", "flipped", "flipped %",
                              "first flip at"], rows)))
    return 0
