"""Engine throughput: ``python -m engines.bench MODEL_DIR [--prompt N] [--tokens N] [--batch B]``.

Prints prefill time and decode tokens/s (greedy, ``--batch`` concurrent
requests). Run it with and without ``LD_PRELOAD`` of OpenBLAS (see
``mlxcel_plugin.openblas``) to compare BLAS back-ends.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import numpy as np

from engines.mlx_engine import MlxEngine
from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest, TokenEvent


def _run(engine: MlxEngine, requests: list[GenerationRequest]) -> tuple[float, float, int]:
    """(seconds to the last first token, seconds in all, tokens) for concurrent requests."""
    done = threading.Semaphore(0)
    first_token_at: list[float] = []
    counts = [0] * len(requests)

    def emitter(i: int):
        def emit(event: TokenEvent) -> None:
            counts[i] += event.token_id is not None
            if event.index == 0:
                first_token_at.append(time.perf_counter())
            if event.finish_reason is not None:
                done.release()

        return emit

    start = time.perf_counter()
    for i, request in enumerate(requests):
        engine.generate(request, emitter(i))
    for _ in requests:
        done.acquire()
    return max(first_token_at) - start, time.perf_counter() - start, sum(counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    engine = MlxEngine.from_path(args.model, EngineConfig())
    engine.start()
    rng = np.random.default_rng(0)
    requests = [
        GenerationRequest(
            f"bench-{i}", tuple(int(t) for t in rng.integers(3, 49152, args.prompt)), args.tokens
        )
        for i in range(args.batch)
    ]
    ttft, total, tokens = _run(engine, requests)
    engine.close()
    decode_tokens = tokens - len(requests)
    print(
        f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r} model={engine.info.model_id} "
        f"prompt={args.prompt} batch={args.batch}: prefill+first token {ttft:.3f}s, "
        f"decode {decode_tokens / (total - ttft):.1f} tokens/s"
    )


if __name__ == "__main__":
    main()
