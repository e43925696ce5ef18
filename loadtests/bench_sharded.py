"""Per-token decode time of a model sharded over 2 local ranks against the same model whole.

For each model (the tiny test llama, and a random "mid" llama of ~40M
parameters: hidden 512, 8 layers, 8 heads / 4 KV heads) and each batch size,
rank 0 runs the unsharded engine and the sharded one (mlx ring over
127.0.0.1, rank 1 a child process) alternately on the same requests, and prints:

* ``step_ms``: the median gap between a sequence's successive tokens once the
  whole batch decodes (one decode step for the batch), median of ``--rounds``
  runs taken alternately with the other engine;
* ``tok_s``: tokens per second over the batch (batch / step);
* ``frame_us``: one protocol frame (a 1 KiB all-reduce on the ring), and
  ``collectives``: how many a sharded step runs (2 per layer inside the model,
  1 from the leader's protocol: the step's tokens, saying no command waits).

    python loadtests/bench_sharded.py [--quick] [--tokens 48] [--batches 1,4] [--rounds 3]
        [--json PATH]

On two shared loopback cores the ranks contend for the same cores, so this
measures the cost of the split (collectives, the protocol) more than any
gain; the gain needs ranks on separate machines or cores (docs/design.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_common import bench_result, table, write_json

from mlxcel_plugin import openblas
from mlxcel_plugin.shard_ranks import follower_argv, write_loopback_hostfile

MID_LLAMA = {
    "model_type": "llama", "hidden_size": 512, "intermediate_size": 2048,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 64, "vocab_size": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 4096, "tie_word_embeddings": False,
}
PROMPT_TOKENS = 32
RUN_TIMEOUT_S = 900


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, batch 1, 16 tokens")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per request")
    parser.add_argument("--batches", default="1,4", help="comma-separated batch sizes")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs per batch size")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--leader", help=argparse.SUPPRESS)  # rank 0's child run: a model dir
    return parser.parse_args(argv)


# -- rank 0 (a child process with the ring in its env) ---------------------------------


def _step_gaps(engine, batch: int, tokens: int, tag: str) -> list[float]:
    from mlxcel_plugin.engine_api import GenerationRequest

    times: list[list[float]] = [[] for _ in range(batch)]
    done = threading.Semaphore(0)

    def sink(i: int):
        def emit(event) -> None:
            times[i].append(time.perf_counter())
            if event.finish_reason is not None:
                done.release()
        return emit

    for i in range(batch):
        prompt = tuple(range(3 + i, 3 + i + PROMPT_TOKENS))
        engine.generate(GenerationRequest(f"{tag}-{i}", prompt, tokens), sink(i))
    for _ in range(batch):
        done.acquire()
    while engine.stats().active_sequences:  # the step's tokens broadcast after the emits
        time.sleep(0.01)
    # From the 3rd token on, every sequence of the batch is in the running batch.
    return [b - a for seq in times for a, b in zip(seq[2:-1], seq[3:], strict=False)]


def _frame_us(group) -> float:
    """One protocol frame (a 1 KiB all-reduce): empty iterations the idle follower runs too."""
    from engines.sharding.protocol import send_end

    started, rounds = time.perf_counter(), 200
    for _ in range(rounds):
        send_end(group, True)
    return (time.perf_counter() - started) / rounds * 1e6


def leader(model: str, batches: list[int], tokens: int, rounds: int) -> dict:
    """Both engines up at once, measured alternately: this box's load moves by the minute."""
    from engines.mlx_engine import MlxEngine
    from engines.plugin import make_mlx_engine
    from mlxcel_plugin.engine_api import EngineConfig

    config = EngineConfig(warmup=True)
    engines = {"whole": MlxEngine.from_path(model, config),
               "sharded": make_mlx_engine(model, config)}
    out: dict = {kind: {} for kind in engines}
    for engine in engines.values():
        engine.start()
    try:
        for batch in batches:
            runs: dict[str, list[float]] = {kind: [] for kind in engines}
            for r in range(rounds):
                for kind, engine in engines.items():
                    gaps = _step_gaps(engine, batch, tokens, f"{kind}{batch}-{r}")
                    runs[kind].append(statistics.median(gaps))
            for kind in engines:
                out[kind][batch] = statistics.median(runs[kind])
        out["frame_us"] = _frame_us(engines["sharded"].leader.group)  # its engine idles now
        out["layers"] = len(engines["sharded"].info.fingerprint["layers"])
    finally:
        for engine in engines.values():
            engine.close()
    return out


# -- the driver ------------------------------------------------------------------------


def mid_llama(root: Path) -> Path:
    """A random llama of MID_LLAMA's shape (no tokenizer: the engine runs token ids)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    out = root / "mid-llama"
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(MID_LLAMA))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(MID_LLAMA))
    return out


def run_pair(model: Path, batches: list[int], tokens: int, rounds: int, workdir: Path) -> dict:
    hostfile = write_loopback_hostfile(2, workdir)
    env = openblas.preload_env(os.environ) or dict(os.environ)
    env["MLX_HOSTFILE"] = str(hostfile)
    follower = subprocess.Popen(follower_argv(str(model)), env={**env, "MLX_RANK": "1"})
    try:
        argv = [sys.executable, __file__, "--leader", str(model), "--tokens", str(tokens),
                "--batches", ",".join(map(str, batches)), "--rounds", str(rounds)]
        done = subprocess.run(argv, env={**env, "MLX_RANK": "0"}, capture_output=True,
                              text=True, timeout=RUN_TIMEOUT_S, check=True)
    finally:
        follower.wait(timeout=60)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    batches = [1] if args.quick else [int(b) for b in args.batches.split(",")]
    tokens = 16 if args.quick else args.tokens
    if args.leader:
        print(json.dumps(leader(args.leader, batches, tokens, args.rounds)))
        return 0
    from engines.model_store import ensure_tiny_model

    workdir = Path(tempfile.mkdtemp(prefix="bench-sharded-"))
    models = {"tiny": ensure_tiny_model()}
    if not args.quick:
        models["mid"] = mid_llama(workdir)
    rows = []
    for name, path in models.items():
        got = run_pair(path, batches, tokens, 1 if args.quick else args.rounds, workdir)
        for batch in batches:
            for kind in ("whole", "sharded"):
                step_s = got[kind][str(batch)]
                ranks = 2 if kind == "sharded" else 1
                rows.append([name, batch, ranks, round(step_s * 1e3, 2),
                             round(batch / step_s, 1), round(got["frame_us"]),
                             2 * got["layers"] + 1 if ranks == 2 else 0])
                print(f"{name} batch {batch} {kind}: {step_s * 1e3:.2f} ms/step, "
                      f"{batch / step_s:.1f} tok/s", flush=True)
    result = bench_result("sharded", [table(
        "decode step, sharded over 2 local ranks vs whole",
        ["model", "batch", "ranks", "step_ms", "tok_s", "frame_us", "collectives"], rows)])
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
