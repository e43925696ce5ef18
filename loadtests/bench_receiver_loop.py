"""The decode node's event-loop CPU per handoff, without a link: the KV layer's own Python.

A handoff of an 8B model's K/V shape (32 layers, 8 KV heads, head_dim 128, 2-byte
storage) is framed as a prefill node frames it for 2 bulk lanes
(``nodes/kv_wire.frames_for``), then fed to a ``HandoffReceiver`` as a decode node
does: ``body_destination`` for each KV_CHUNK frame (the MLX engine's receive
buffers, ``engines/kv_convert``), the bodies taken as landed there (no bytes are
copied: the link's threads do that), then ``feed``, which adopts each layer into MLX
as it completes. What is timed is this thread's CPU inside those two calls, per
handoff: what a decode node's event loop spends on KV bookkeeping, apart from the
link's framing, its bulk threads and the engine. Median of ``--repeats`` handoffs
after ``--warmup``, per prompt length and chunk size (``record``: one record's
8 MiB - 64 KiB, as towards a receiver of serde version 4; ``large``: 32 MiB, serde
version 5), alternating. On a quiet core; a busy node's loop reads ~2x these.

    .venv/bin/python loadtests/bench_receiver_loop.py [--tokens 2048,8192] [--repeats 15]
        [--profile 8192:large]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import sys
import time
from pathlib import Path
from statistics import median

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import mlx.core as mx  # noqa: E402

from engines import kv_convert  # noqa: E402
from mlxcel_plugin.builtin_plugin import TRANSFER_STRATEGIES, builtin_codecs  # noqa: E402
from mlxcel_plugin.kv_serde import DEFAULT_MAX_BODY_BYTES, SERDE_VERSION, KVMessage  # noqa: E402
from mlxcel_plugin.kv_serde.header import CHECKSUM_OF_NONE  # noqa: E402
from mlxcel_plugin.kv_serde.versions import (  # noqa: E402
    LARGE_CHUNK_BYTES,
    LARGE_CHUNK_SERDE_VERSION,
)
from mlxcel_plugin.link.protocol.frames import FrameType  # noqa: E402
from mlxcel_plugin.link.read_load import ReadLoad  # noqa: E402
from mlxcel_plugin.nodes import kv_wire  # noqa: E402
from mlxcel_plugin.nodes.handoff_receiver import Completed, HandoffReceiver  # noqa: E402
from mlxcel_plugin.testing.caches import make_cache, make_fingerprint, make_header  # noqa: E402
from mlxcel_plugin.transfer import make_strategy, plan_transfer  # noqa: E402

FINGERPRINT = make_fingerprint(num_layers=32, kv_heads=8, head_dim=128, dtype="float16")
CODECS = builtin_codecs()
STRATEGIES = {strategy.name: strategy for strategy in TRANSFER_STRATEGIES}
CHUNKS = {"record": DEFAULT_MAX_BODY_BYTES, "large": LARGE_CHUNK_BYTES}
LANES = 2


class _Link:
    """What ``feed`` uses of a link: its bulk readers' load."""

    def bulk_read_load(self) -> ReadLoad:
        return ReadLoad()


def handoff_frames(tokens: int, chunk: str) -> list:
    """The handoff's frames as a prefill node sends them (codec none, no checksums)."""
    version = LARGE_CHUNK_SERDE_VERSION if chunk == "large" else SERDE_VERSION
    header = dataclasses.replace(make_header(FINGERPRINT, tokens), checksum_of=CHECKSUM_OF_NONE,
                                 version=version)
    kv = np.zeros((1, FINGERPRINT.kv_heads, tokens, FINGERPRINT.head_dim), np.float16)
    small = make_cache(FINGERPRINT, 1)
    cache = dataclasses.replace(small, layers=[
        dataclasses.replace(layer, keys=kv, values=kv, offset=tokens) for layer in small.layers])
    strategy = make_strategy("full", "none", STRATEGIES, CODECS, chunk_bytes=CHUNKS[chunk],
                             max_body_bytes=CHUNKS[chunk])
    messages: list[KVMessage] = plan_transfer(strategy, header, cache)
    bound = kv_wire.frame_chunk_bytes(messages, [LANES])
    return [frame for _, frame in kv_wire.frames_for(messages, max_chunk_bytes=bound)]


def receive(frames: list, buffers, stream, profile: cProfile.Profile | None = None) -> float:
    """One handoff through a fresh receiver; this thread's CPU seconds inside its calls."""
    receiver = HandoffReceiver(FINGERPRINT, CODECS, admit=lambda header: None,
                               adopt=lambda layer: kv_convert.adopt_layer(layer, stream),
                               make_buffers=buffers)
    link, busy, outcome = _Link(), 0.0, None
    for frame in frames:
        start = time.thread_time()
        if profile:
            profile.enable()
        into = receiver.body_destination(frame.type, frame.header, len(frame.body))
        if into is not None:  # the link's threads would have decrypted the body there
            frame = type(frame)(frame.type, frame.header, into)
        outcome = receiver.feed(link, frame) or outcome
        if profile:
            profile.disable()
        busy += time.thread_time() - start
    if not isinstance(outcome, Completed):
        raise RuntimeError(f"the handoff did not complete: {outcome}")
    return busy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="2048,8192")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", default="", help="TOKENS:CHUNK to profile once, after")
    args = parser.parse_args()
    buffers, stream = kv_convert.ReceiveBuffers(), mx.new_stream(mx.cpu)
    cases = [(int(t), chunk) for t in args.tokens.split(",") for chunk in CHUNKS]
    frames = {case: handoff_frames(*case) for case in cases}
    for case in cases * args.warmup:
        receive(frames[case], buffers, stream)
    times: dict[tuple[int, str], list[float]] = {case: [] for case in cases}
    for _ in range(args.repeats):  # alternating: every case sees the same machine
        for case in cases:
            times[case].append(receive(frames[case], buffers, stream))
    print(f"{'tokens':>6} {'chunks':>6} {'frames':>6} {'count':>5} {'median ms':>9} {'min ms':>7}")
    for case in cases:
        count = sum(len(kv_wire.chunk_headers(f.header)) for f in frames[case]
                    if f.type is FrameType.KV_CHUNK)
        print(f"{case[0]:>6} {case[1]:>6} {len(frames[case]):>6} {count:>5} "
              f"{median(times[case]) * 1e3:>9.2f} {min(times[case]) * 1e3:>7.2f}")
    if args.profile:
        tokens, chunk = args.profile.split(":")
        profile = cProfile.Profile(time.thread_time)
        receive(handoff_frames(int(tokens), chunk), buffers, stream, profile)
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
