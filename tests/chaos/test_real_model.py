"""Chaos on the real engine: a decode node killed mid-stream on the tiny checkpoint.

The migrated streams re-prefill prompt + streamed tokens on the surviving pair; for greedy and
seeded requests the output must equal the no-fault output (docs/cluster-flow.md, "Migration":
the seeded sampler draws from (seed, absolute position), which the longer prompt keeps).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.harness import ChaosCluster

pytestmark = pytest.mark.timeout(600)

PROMPTS = [f"Tell me about the number {i}." for i in range(4)]
# Started one after the other, round robin puts streams 0 and 2 on one decode node, 1 and 3 on
# the other: each node serves a greedy and a seeded stream.
SEEDS = [None, None, 7, 11]
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def real(tiny_model_path: Path, tmp_path_factory) -> Iterator[ChaosCluster]:
    args = ["--engine", "mlx", "--served-model-name", "tiny", "--no-warmup",
            "--prefill-balancer", "round-robin", "--decode-balancer", "round-robin"]
    cluster = ChaosCluster(tmp_path_factory.mktemp("chaos-real"), str(tiny_model_path), args,
                           "[health]\ninterval_s = 0.25\nping_timeout_s = 1.0\n",
                           prefill_count=1, decode_count=2)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def run_all(cluster: ChaosCluster, on_tokens=None) -> list:
    """The streams, each started once the one before has its first token."""
    futures = []
    for i, (prompt, seed) in enumerate(zip(PROMPTS, SEEDS, strict=True)):
        first = threading.Event()

        def seen(chunks: int, first=first, i=i) -> None:
            first.set()
            if on_tokens is not None:
                on_tokens(i, chunks)

        futures += cluster.streams([prompt], MAX_TOKENS, seed=seed, on_tokens=seen)
        first.wait(60)
    return [f.result(timeout=300) for f in futures]


def test_a_migrated_stream_equals_the_no_fault_output(real: ChaosCluster) -> None:
    baseline = run_all(real)
    assert all(o.ok and o.finish_reason == "length" for o in baseline), baseline
    started = threading.Event()
    futures_done = []

    def on_tokens(stream: int, chunks: int) -> None:
        if stream == len(PROMPTS) - 1 and chunks >= 5:  # every stream is under way
            started.set()

    migrated = real.stats()["metrics"]["migrated"]
    thread = threading.Thread(target=lambda: futures_done.append(run_all(real, on_tokens)))
    thread.start()
    assert started.wait(120)
    real.signal("decode-0", signal.SIGKILL)
    thread.join(300)
    faulted = futures_done[0]
    # Both of the killed node's streams (a greedy and a seeded one) moved mid-stream.
    assert real.stats()["metrics"]["migrated"] - migrated == 2
    for before, after in zip(baseline, faulted, strict=True):
        assert after.ok, after
        assert after.text == before.text
