"""Decode tok/s of one batch of 8 sequences mixing LoRA adapters (issue 36, item 4).

Each case decodes the same 8 prompts together, greedy, ``--steps`` tokens after a
shared-length prompt: all on the base; all on one adapter; 4 distinct adapters
(2 rows each); 8 distinct adapters (one row each). The adapted layers gather each
row's A and B (``engines/lora/multi_lora.py``): no weights fused, no batch split.
Target: 8 distinct adapters >= 0.8x the single-adapter batch's tok/s. The cases run in
turn, ``--repeats`` rounds: each case's best round is printed, and the 8/1 ratio both as best
over best and as the median of the rounds' paired ratios. Also: the
time to load one adapter (``AdapterSet.load``) and the first token after it, in
this process and on a real hybrid node (``POST /v1/load_lora_adapter``, then a
streaming request naming it: ``adapter_node_ttft.py``; ``--no-node`` skips it).

    .venv/bin/python loadtests/bench_adapters.py               # SmolLM2-135M
    .venv/bin/python loadtests/bench_adapters.py --model tiny --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import load  # noqa: E402

from engines.lora.adapter_set import AdapterSet  # noqa: E402
from engines.lora.random_adapter import write_random_adapter  # noqa: E402
from engines.model_store import ensure_default_model, ensure_tiny_model  # noqa: E402
from loadtests.adapter_node_ttft import NodeLoadTiming, node_load_timing  # noqa: E402
from mlxcel_plugin import openblas  # noqa: E402
from tests.conftest import model_cache_root  # noqa: E402

BATCH = 8
PROMPT_TOKENS = 64


def decode_tok_s(model, served: AdapterSet, names: list[str | None], steps: int) -> float:
    prompts = mx.array([[1 + (row * 131 + i * 7) % 5000 for i in range(PROMPT_TOKENS)]
                        for row in range(BATCH)])  # fmt: skip
    served.use(names)
    cache = make_prompt_cache(model)
    token = mx.argmax(model(prompts, cache=cache)[:, -1], axis=-1)
    mx.eval(token)
    start = time.perf_counter()
    for _ in range(steps):
        token = mx.argmax(model(token[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(token)
    return BATCH * steps / (time.perf_counter() - start)


def cases() -> dict[str, list[str | None]]:
    return {
        "base x8": [None] * BATCH,
        "1 adapter x8": ["a0"] * BATCH,
        "4 adapters x2": [f"a{row % 4}" for row in range(BATCH)],
        "8 adapters x1": [f"a{row}" for row in range(BATCH)],
    }


def interleaved_rounds(model, served: AdapterSet, steps: int,
                       repeats: int) -> list[dict[str, float]]:  # fmt: skip
    """``repeats`` rounds of every case in turn: a load that drifts (a shared machine) weighs
    on every case of a round alike."""
    return [{name: decode_tok_s(model, served, rows, steps) for name, rows in cases().items()}
            for _ in range(repeats)]  # fmt: skip


def best_tok_s(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {name: max(r[name] for r in rounds) for name in cases()}


def median_ratio(rounds: list[dict[str, float]]) -> float:
    """8 distinct adapters over one adapter, paired within each round, median of the rounds."""
    return statistics.median(r["8 adapters x1"] / r["1 adapter x8"] for r in rounds)


def first_token_after_load(model, served: AdapterSet, path: Path) -> tuple[float, float]:
    start = time.perf_counter()
    served.load("fresh", path)
    loaded = time.perf_counter()
    served.use(["fresh"])
    mx.eval(model(mx.array([[1, 2, 3, 4]]), cache=make_prompt_cache(model)))
    return loaded - start, time.perf_counter() - start


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--no-node", action="store_true", help="skip the hybrid node's load")
    return parser.parse_args()


def report(args: argparse.Namespace, rounds: list[dict[str, float]],
           in_process: tuple[float, float], node: NodeLoadTiming | None) -> None:  # fmt: skip
    figures = best_tok_s(rounds)
    print(
        f"model {args.model}, batch {BATCH}, {args.steps} steps, rank {args.rank}, "
        f"best of {args.repeats}; LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r} "
        "(this process, as engine nodes do)"
    )
    for name, tok_s in figures.items():
        print(f"  {name:<15} {tok_s:8.1f} tok/s")
    ratio = figures["8 adapters x1"] / figures["1 adapter x8"]
    print(
        f"8 distinct / 1 adapter: {ratio:.2f}x best over best, {median_ratio(rounds):.2f}x "
        f"median of {len(rounds)} paired rounds (target >= 0.8x)"
    )
    print(
        f"in process: AdapterSet.load {in_process[0] * 1000:.1f} ms; first token after it: "
        f"{in_process[1] * 1000:.1f} ms"
    )
    if node is not None:
        print(
            f"hybrid node: load_lora_adapter {node.load_s * 1000:.1f} ms (HTTP); first token "
            f"after it: {node.adapter_ttft_s * 1000:.1f} ms (base: "
            f"{node.base_ttft_s * 1000:.1f} ms, {PROMPT_TOKENS}-token prompts)"
        )


def reexec_with_openblas() -> None:
    """Measure with the BLAS the engine nodes run: OpenBLAS preloaded needs a fresh process."""
    env = openblas.preload_env(os.environ)
    if env is not None:
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main() -> None:
    reexec_with_openblas()
    args = parse_args()
    model_path = (ensure_default_model if args.model == "smollm2" else ensure_tiny_model)(
        root=model_cache_root()
    )
    model, _ = load(str(model_path))
    served = AdapterSet(model)
    with tempfile.TemporaryDirectory() as root:
        for seed in range(BATCH + 1):
            write_random_adapter(model, Path(root) / f"a{seed}", seed=seed, rank=args.rank)
        for seed in range(BATCH):
            served.load(f"a{seed}", Path(root) / f"a{seed}")
        rounds = interleaved_rounds(model, served, args.steps, args.repeats)
        in_process = first_token_after_load(model, served, Path(root) / f"a{BATCH}")
        prompt = [1 + (i * 7) % 5000 for i in range(PROMPT_TOKENS)]
        node = None if args.no_node else node_load_timing(model_path, Path(root) / f"a{BATCH}",
                                                          Path(root), prompt)  # fmt: skip
    report(args, rounds, in_process, node)


if __name__ == "__main__":
    main()
