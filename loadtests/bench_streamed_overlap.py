"""Streamed KV transfer: how much of the transfer hides behind prefill (SmolLM2, OpenBLAS).

Per prompt length and ``EngineConfig.chunk_size_tokens``, alternating each repeat:

* prefill alone: ``engine.prefill`` (the prefill role, numpy export included)
* transfer alone: that cache through ``StreamedTransfer`` over a real link to a
  receiver process (KVAssembler + ``mx.array``), clock to its ack
* streamed: ``engine.prefill`` with ``on_layer`` feeding ``StreamedTransfer``
  over the same link, clock from submit to the ack

hidden fraction = (prefill + transfer - streamed) / transfer. On a shared
2-core box prefill time varies by more than a whole transfer takes, so that
difference of medians is noisy; the table also gives the streamed run's
*tail* (ack minus end of its prefill: the transfer work left once prefill is
done) and hidden-by-tail = (transfer - tail) / transfer, which does not
subtract two noisy prefill times (it ignores any prefill slowdown instead).
"of which receiver end" is the receiver's own work after the last byte (crc32
verify of the whole cache + ``mx.array``), which no sender-side overlap can hide.

The engine evaluates full chunks as it goes and calls ``on_layer`` only while
the *last* chunk is evaluated layer by layer (``engines/prefill.py``), so only
that window can overlap the transfer. The table shows when the first layer
arrives (% of prefill) and the window's length; a larger chunk widens it.
SmolLM2's context is 8192 tokens and the engine needs prompt < context, so
"8k" runs 8191 tokens. Sender, receiver and MLX share this machine's cores.

Usage: python loadtests/bench_streamed_overlap.py [--quick] [--json PATH]
       [--lengths 2048,8191] [--chunks 512] [--repeats 2]   (chunk 0 = whole prompt)

The default chunk is the engine's own (``EngineConfig.chunk_size_tokens``), what a
node runs with; on 2 cores the default run takes ~10 minutes, and each further
chunk size (say ``--chunks 512,2048,0``) as long again.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from bench_common import add_common_args, bench_result, table, write_json
from bench_kv_handoff import HandoffSender, Peer, handoff_once, new_strategy, start_peer

from mlxcel_plugin import openblas
from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest, PrefillResult
from mlxcel_plugin.kv_serde import ModelFingerprint
from mlxcel_plugin.testing.caches import make_header
from mlxcel_plugin.transfer import StreamedTransfer

STREAMED = StreamedTransfer.name
PREFILL_TIMEOUT_S = 600.0
ENGINE_CHUNK = EngineConfig().chunk_size_tokens  # what a node prefills with
MB = 1e6


def reexec_with_openblas() -> None:
    env = openblas.preload_env(os.environ)
    if env is not None:
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


@dataclass
class PrefillRun:
    """An ``engine.prefill`` observed from the asyncio loop."""

    seconds: float = 0.0
    layer_times_s: list[float] = field(default_factory=list)  # since submit
    result: PrefillResult | None = None
    receiver_end_s: float = 0.0  # streamed only: receiver's verify + mx.array at the end


async def run_prefill(
    engine: Any, request: GenerationRequest, sender: HandoffSender | None = None
) -> PrefillRun:
    """Prefill; with a sender, each layer goes on the wire as ``on_layer`` delivers it."""
    loop = asyncio.get_running_loop()
    items: asyncio.Queue[Any] = asyncio.Queue()
    run = PrefillRun()
    start = time.perf_counter()
    engine.prefill(
        request,
        lambda result: loop.call_soon_threadsafe(items.put_nowait, result),
        lambda i, layer: loop.call_soon_threadsafe(
            items.put_nowait, (i, layer, time.perf_counter() - start)
        ),
    )
    while True:  # one item per layer, then the result (bounded by the model's layers)
        item = await asyncio.wait_for(items.get(), PREFILL_TIMEOUT_S)
        if isinstance(item, Exception):
            raise item
        if not isinstance(item, tuple):
            run.seconds, run.result = time.perf_counter() - start, item
            return run
        index, layer, at_s = item
        run.layer_times_s.append(at_s)
        if sender is not None:
            await sender.add_layer(index, layer)


async def streamed_once(
    engine: Any, peer: Peer, request: GenerationRequest, fingerprint: ModelFingerprint
) -> tuple[float, PrefillRun]:
    links = await peer.ensure_links(1)
    header = make_header(
        fingerprint, len(request.prompt_tokens), handoff_id=f"{request.request_id}-streamed"
    )
    sender = HandoffSender(new_strategy(STREAMED, "none", 1), links)
    start = time.perf_counter()
    await sender.start(header)
    run = await run_prefill(engine, request, sender)
    await sender.finish(run.result.first_token)
    ack = await sender.acked(peer)
    if ack.get("handoff_id") != header.handoff_id:
        raise RuntimeError(f"unexpected ack {ack}")
    # The receiver's work after the last byte: crc32 verify of the whole cache + mx.array.
    run.receiver_end_s = float(ack["complete_s"]) + float(ack["mlx_s"])
    return time.perf_counter() - start, run


@dataclass
class Case:
    tokens: int
    chunk: int
    prefill_s: list[float] = field(default_factory=list)
    transfer_s: list[float] = field(default_factory=list)
    streamed_s: list[float] = field(default_factory=list)
    first_layer_s: list[float] = field(default_factory=list)
    streamed_prefill_s: list[float] = field(default_factory=list)
    hidden: list[float] = field(default_factory=list)
    receiver_end_s: list[float] = field(default_factory=list)
    cache_bytes: int = 0

    def row(self) -> list[Any]:
        m = statistics.median
        prefill, transfer, streamed = m(self.prefill_s), m(self.transfer_s), m(self.streamed_s)
        window = prefill - m(self.first_layer_s)
        tails = [
            total - inner
            for total, inner in zip(self.streamed_s, self.streamed_prefill_s, strict=True)
        ]
        tail = m(tails)
        return [
            self.tokens,
            self.chunk,
            round(self.cache_bytes / MB),
            len(self.prefill_s),
            round(prefill, 2),
            round(100 * m(self.first_layer_s) / prefill),
            round(window, 2),
            round(transfer, 3),
            round(streamed, 2),
            round(100 * (prefill + transfer - streamed) / transfer),
            round(1000 * tail),
            round(1000 * m(self.receiver_end_s)),
            round(100 * (transfer - tail) / transfer),
            round(100 * min(1.0, window / transfer)),
        ]


COLUMNS = [
    "prompt tokens",
    "chunk",
    "cache MB",
    "runs",
    "prefill s",
    "first layer at %",
    "on_layer window s",
    "transfer s",
    "streamed s",
    "hidden %",
    "tail ms",
    "of which receiver end ms",
    "hidden by tail %",
    "bound %",
]


def prompt_tokens(length: int, vocab: int) -> tuple[int, ...]:
    return tuple(np.random.default_rng(length).integers(100, vocab, size=length).tolist())


async def measure(engine: Any, peer: Peer, case: Case, repeats: int) -> Case:
    fingerprint = ModelFingerprint.from_dict(engine.info.fingerprint)
    tokens = prompt_tokens(case.tokens, engine.info.vocab_size)
    for repeat in range(repeats):
        tag = f"t{case.tokens}-c{case.chunk}-r{repeat}"
        alone = await run_prefill(engine, GenerationRequest(f"{tag}-alone", tokens, 1))
        cache = alone.result.cache
        header = make_header(fingerprint, case.tokens, handoff_id=f"{tag}-transfer")
        transfer = await handoff_once(peer, STREAMED, 1, header, cache)
        streamed_s, run = await streamed_once(
            engine, peer, GenerationRequest(tag, tokens, 1), fingerprint
        )
        case.cache_bytes = cache.nbytes
        case.prefill_s.append(alone.seconds)
        case.first_layer_s.append(alone.layer_times_s[0])
        case.transfer_s.append(transfer.total_s)
        case.streamed_s.append(streamed_s)
        case.streamed_prefill_s.append(run.seconds)
        case.receiver_end_s.append(run.receiver_end_s)
        case.hidden.append((alone.seconds + transfer.total_s - streamed_s) / transfer.total_s)
        print(
            f"  {tag}: prefill {alone.seconds:.2f}s (first layer at "
            f"{alone.layer_times_s[0]:.2f}s), transfer {transfer.total_s:.3f}s, streamed "
            f"{streamed_s:.2f}s -> hidden {100 * case.hidden[-1]:.0f}%",
            flush=True,
        )
    return case


async def run_all(
    model: str,
    lengths: list[int],
    chunks: list[int],
    repeats: int,
) -> list[Case]:
    from engines.plugin import make_mlx_engine

    peer = start_peer()
    cases = []
    try:
        for chunk in chunks:
            # One engine per chunk size: it is engine configuration (shared with hybrid).
            size = chunk or max(lengths)
            engine = make_mlx_engine(model, EngineConfig(chunk_size_tokens=size))
            engine.start()
            try:
                for length in lengths:
                    case = Case(length, chunk or length)
                    reps = repeats if length <= 4096 else max(1, repeats // 2)
                    cases.append(await measure(engine, peer, case, reps))
                    print("row", cases[-1].row(), flush=True)
            finally:
                engine.close()
    finally:
        await peer.close()
    return cases


def main() -> None:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--lengths", default="2048,8191", help="prompt tokens (< 8192)")
    parser.add_argument(
        "--chunks",
        default=str(ENGINE_CHUNK),
        help="chunk_size_tokens variants (default: the engine's); 0 = whole prompt in one chunk",
    )
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    reexec_with_openblas()
    from engines.model_store import ensure_default_model

    lengths = [2048] if args.quick else [int(n) for n in args.lengths.split(",")]
    chunks = [ENGINE_CHUNK] if args.quick else [int(n) for n in args.chunks.split(",")]
    repeats = 1 if args.quick else args.repeats
    cases = asyncio.run(run_all(str(ensure_default_model()), lengths, chunks, repeats))
    columns = COLUMNS
    rows = [case.row() for case in cases]
    for row in rows:
        print(dict(zip(columns, row, strict=True)), flush=True)
    tables = [
        table(
            "Streamed transfer hidden behind prefill (SmolLM2-135M fp32, OpenBLAS; "
            "median; bound = on_layer window / transfer)",
            columns,
            rows,
        )
    ]
    series = {
        "hidden_pct": [row[9] for row in rows],
        "hidden_by_tail_pct": [row[12] for row in rows],
        "prompt_tokens": [row[0] for row in rows],
        "chunk": [row[1] for row in rows],
    }
    if args.json:
        write_json(args.json, bench_result("streamed_overlap", tables, series))


if __name__ == "__main__":
    main()
