"""Rank 0 of a 2-rank sharded engine beside an unsharded one (tests/engines/sharding/test_ranks.py).

``python -m tests.engines.sharding_child MODEL`` (with ``MLX_HOSTFILE``/``MLX_RANK=0``
set and rank 1 running ``engines.sharding.follower``) prints one JSON object:
the tokens of each case on the unsharded engine, the sharded one, and across
them (sharded prefill -> unsharded decode, and the reverse), plus how close
the two engines' first-token logits and handed-off K/V are; and the greedy
requests again with prompt lookup, while rank 0 times its forwards as dearer
per row than rank 1 can (its learned row cost is what both ranks must use).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading

import numpy as np

from engines.mlx_engine import MlxEngine
from engines.plugin import make_mlx_engine
from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest, SamplingParams
from tests.engines import support

PROMPTS = [list(range(5, 25)), [7, 300, 41, 9000, 12, 3] * 6, list(range(1000, 1003))]
MAX_TOKENS = 24
SEEDED = SamplingParams(temperature=0.8, seed=11)


def requests(tag: str) -> list[GenerationRequest]:
    out = [GenerationRequest(f"{tag}-g{i}", tuple(p), MAX_TOKENS) for i, p in enumerate(PROMPTS)]
    out.append(GenerationRequest(f"{tag}-s", tuple(PROMPTS[1]), MAX_TOKENS, SEEDED))
    return out


def together(engine, reqs: list[GenerationRequest]) -> list[list[int]]:
    """All at once: they share the decode batch."""
    events = [support.Events() for _ in reqs]
    for request, sink in zip(reqs, events, strict=True):
        engine.generate(request, sink)
    return [sink.wait() and sink.tokens for sink in events]


class FailingConsumer(support.Events):
    """Raises on its third token: rank 0 must cancel it on every rank, not drop it alone."""

    def __call__(self, event) -> None:
        super().__call__(event)
        if len(self.events) == 3:
            raise RuntimeError("consumer gone")


def ranks_stay_in_step(engine) -> list[list[int]]:
    """A consumer that fails and a request cancelled mid-decode, beside ones that finish."""
    failing, cancelled, after = FailingConsumer(), support.Events(), support.Events()
    long = GenerationRequest("c-long", tuple(PROMPTS[0]), 400)
    engine.generate(GenerationRequest("c-fail", tuple(PROMPTS[0]), 400), failing)
    engine.generate(long, cancelled)
    while len(cancelled.events) < 4:
        cancelled.done.wait(0.01)
    engine.cancel(long.request_id)
    cancelled.wait()
    while engine.stats().active_sequences:  # the failed consumer's cancel went through
        failing.done.wait(0.01)
    engine.generate(requests("c")[2], after)
    return [after.wait() and after.tokens, [cancelled.last.finish_reason]]


def dear_rows(record_real):
    """Rank 0's verify forwards timed as ``rows - 0.8`` s, each also as one of a row more:
    a learned row cost of 4 one-row forwards (the most) after three verifies, which rank 1,
    timing its own, would never learn: proposals would differ."""
    def record(rows: int, _seconds: float) -> None:
        record_real(rows, rows - 0.8)
        record_real(rows + 1, rows + 0.2)

    return record


def speculating(engine, plain, replies: list[list[int]]) -> dict:
    """Prompt lookup on prompts that hold their own reply (prompt, reply, prompt again: the
    lookup finds what followed), one by one and together; the plain engine's tokens beside."""
    echoes = [GenerationRequest(f"n{i}", (*p, *reply, *p), MAX_TOKENS, SamplingParams(
        speculative="ngram")) for i, (p, reply) in enumerate(zip(PROMPTS, replies, strict=False))]
    # A first pass, so rank 0 has timed verify forwards of two row counts (its cost learned).
    learning = [support.generate(engine, dataclasses.replace(r, request_id=r.request_id + "l"))
                for r in echoes]
    out = {"plain": [support.generate(plain, r).tokens for r in echoes],
           "learning": [events.tokens for events in learning],
           "alone": [support.generate(engine, r).tokens for r in echoes],
           "together": together(engine, [dataclasses.replace(r, request_id=r.request_id + "b")
                                         for r in echoes])}
    counts = engine.stats().speculative.methods.get("ngram")
    out["proposed"] = counts.proposed if counts else 0
    out["leader_row_cost"] = engine.leader._batch.cost.row_cost
    out["leader_samples"] = engine.leader._batch.cost.samples
    return out


def max_kv_gap(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x.keys, np.float32) - np.asarray(y.keys,
                                                                              np.float32))))
               for x, y in zip(a.cache.layers, b.cache.layers, strict=True))


def main() -> None:
    config = EngineConfig(warmup=True, chunk_size_tokens=16)
    plain = MlxEngine.from_path(sys.argv[1], config)
    plain.start()
    sharded = make_mlx_engine(sys.argv[1], config)
    cost = sharded.leader._batch.cost
    cost.record = dear_rows(cost.record)
    sharded.start()
    out: dict = {"ranks": sharded.ranks,
                 "fingerprint_equal": sharded.info.fingerprint == plain.info.fingerprint}
    try:
        out["plain"] = [support.generate(plain, r).tokens for r in requests("p")]
        out["sharded"] = [support.generate(sharded, r).tokens for r in requests("s")]
        out["sharded_batched"] = together(sharded, requests("b"))
        out["sharded_to_plain"] = [support.decode_after(plain, r, support.prefill(sharded, r))
                                   for r in requests("sp")]
        out["plain_to_sharded"] = [support.decode_after(sharded, r, support.prefill(plain, r))
                                   for r in requests("ps")]
        out["in_step_after_cancels"] = ranks_stay_in_step(sharded)
        out["speculating"] = speculating(sharded, plain, out["plain"])
        out["after_speculating"] = support.generate(sharded, requests("a")[0]).tokens
        probe = requests("k")[1]
        out["kv_max_abs_gap"] = max_kv_gap(support.prefill(plain, probe),
                                           support.prefill(sharded, probe))
        out["threads"] = threading.active_count()
    finally:
        sharded.close()
        plain.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
