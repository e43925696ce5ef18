"""KV codec throughput and size ratios on synthetic KV, plus in-process serde throughput.

Numpy only (no MLX): the cache is shaped like SmolLM2-135M's (30 layers, 3 KV
heads, head_dim 64) and filled with per-channel-scaled Gaussian noise (the
pessimistic case: no lossless codec shrinks it) or smooth per-channel
sinusoids (RoPE-like; byte-plane shuffling then helps LZ4). Each codec runs
on the writer's real chunks (``--chunk-mib``) with the layout the writer
passes (K or V, tokens per head, first row), so figures include per-chunk
overheads. Max rel err is the worst |error| over the larger of its row's and
column's max |x| (int8/int4 keys are grouped along tokens, per channel).

``transcode_cache`` (a cache through a codec and back, as a decode node would
receive it) is the hook for the real-model agreement benchmark: prefill with
the engine, transcode, decode, compare tokens with the untouched cache.

Usage: python loadtests/bench_kv_codecs.py [--quick] [--json PATH] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from bench_common import add_common_args, bench_result, table, write_json

from mlxcel_plugin.builtin_plugin import builtin_codecs
from mlxcel_plugin.engine_api import CacheState
from mlxcel_plugin.kv_codecs import (
    ChunkLayout,
    KVCodec,
    resolve_codec,
    to_float32,
)
from mlxcel_plugin.kv_serde import (
    KVAssembler,
    ModelFingerprint,
    SerializableCacheState,
    assemble_messages,
)
from mlxcel_plugin.testing.caches import make_cache, make_fingerprint, make_header

MB = 1e6
CODEC_NAMES = ["none", "lz4", "shuffle+lz4", "int8", "int8+lz4", "int4"]
CODECS = builtin_codecs()


def transcode_cache(cache: CacheState, fingerprint: ModelFingerprint, codec: str) -> CacheState:
    """The cache a decode node would hold after a handoff with ``codec``."""
    tokens = cache.layers[0].offset
    header = make_header(fingerprint, tokens, codec=codec)
    messages = SerializableCacheState(header, cache).to_messages(resolve_codec(codec, CODECS))
    return assemble_messages(messages, fingerprint, CODECS).cache


def best_time(action: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return min(times)


Chunk = tuple[np.ndarray, ChunkLayout]


def chunks_of(cache: CacheState, head_dim: int, chunk_bytes: int) -> list[Chunk]:
    """The writer's chunks, each with the layout the writer hands the codec."""
    rows_per_chunk = max(1, chunk_bytes // (head_dim * cache.layers[0].keys.itemsize))
    chunks = []
    for layer in cache.layers:
        for name, tensor in (("k", layer.keys), ("v", layer.values)):
            rows = tensor.reshape(-1, head_dim)
            tokens = tensor.shape[2]
            chunks.extend(
                (rows[i : i + rows_per_chunk], ChunkLayout(name, tokens, i))
                for i in range(0, len(rows), rows_per_chunk)
            )
    return chunks


def relative_error(chunk: np.ndarray, decoded: np.ndarray, dtype: str) -> float:
    """Worst |error| over the larger of its row's and column's max |x| (a group's extent)."""
    want, got = to_float32(chunk, dtype), to_float32(decoded, dtype)
    magnitude = np.abs(want)
    extent = np.maximum(magnitude.max(axis=-1, keepdims=True), magnitude.max(axis=0)) + 1e-30
    return float((np.abs(got - want) / extent).max())


def codec_figures(codec: KVCodec, chunks: list[Chunk], dtype: str, repeats: int) -> dict:
    raw = sum(chunk.nbytes for chunk, _ in chunks)

    def encode_all() -> list:
        return [codec.encode(chunk, dtype, layout) for chunk, layout in chunks]

    encoded = encode_all()
    encode_s = best_time(encode_all, repeats)

    def decode_all() -> list[np.ndarray]:
        return [
            codec.decode(body, meta, chunk.shape, dtype)
            for (body, meta), (chunk, _) in zip(encoded, chunks, strict=True)
        ]

    decode_s = best_time(decode_all, repeats)
    figures = {
        "ratio": raw / sum(len(body) for body, _ in encoded),
        "encode_mb_s": raw / encode_s / MB,
        "decode_mb_s": raw / decode_s / MB,
        "max_rel_error": 0.0,
    }
    if not codec.lossless:
        figures["max_rel_error"] = max(
            relative_error(chunk, decoded, dtype)
            for (chunk, _), decoded in zip(chunks, decode_all(), strict=True)
        )
    return figures


def serde_figures(fingerprint, cache: CacheState, codec: str, chunk_bytes: int, repeats: int):
    """Whole handoff in one process: writer (encode + crc) and assembler (decode + crc)."""
    header = make_header(fingerprint, cache.layers[0].offset, codec=codec)
    state = SerializableCacheState(header, cache)
    codec_obj = resolve_codec(codec, CODECS)
    messages = state.to_messages(codec_obj, chunk_bytes)

    def assemble() -> None:
        assembler = KVAssembler(fingerprint, CODECS)
        for message in messages:
            assembler.feed(message)

    send_s = best_time(lambda: state.to_messages(codec_obj, chunk_bytes), repeats)
    receive_s = best_time(assemble, repeats)
    return cache.nbytes / send_s / MB, cache.nbytes / receive_s / MB


def main() -> None:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens in the cache")
    parser.add_argument("--chunk-mib", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokens = 256 if args.quick else args.tokens
    repeats = 1 if args.quick else args.repeats
    chunk_bytes = int(args.chunk_mib * (1 << 20))

    codec_rows, serde_rows = [], []
    series: dict[str, list[float]] = {}
    for dtype in ("float16", "bfloat16", "float32"):
        fingerprint = make_fingerprint(30, 3, 64, dtype)
        for data in ("noise", "smooth"):
            cache = make_cache(fingerprint, tokens, seed=1, smooth=data == "smooth")
            chunks = chunks_of(cache, fingerprint.head_dim, chunk_bytes)
            for name in CODEC_NAMES:
                fig = codec_figures(resolve_codec(name, CODECS), chunks, dtype, repeats)
                codec_rows.append(
                    [
                        dtype,
                        data,
                        name,
                        round(fig["ratio"], 3),
                        round(fig["encode_mb_s"]),
                        round(fig["decode_mb_s"]),
                        f"{fig['max_rel_error']:.4f}",
                    ]
                )
                series.setdefault(f"ratio_{name}", []).append(fig["ratio"])
                print(" ".join(f"{cell!s:>12}" for cell in codec_rows[-1]), flush=True)
        for name in ("none", "lz4"):
            send, receive = serde_figures(fingerprint, cache, name, chunk_bytes, repeats)
            serde_rows.append(
                [dtype, name, round(cache.nbytes / MB, 1), round(send), round(receive)]
            )
            print("serde", " ".join(f"{cell!s:>10}" for cell in serde_rows[-1]), flush=True)

    tables = [
        table(
            f"Codecs on synthetic KV ({tokens} tokens, 30 layers x 3 heads x 64, "
            f"{args.chunk_mib} MiB chunks; MB/s of raw bytes)",
            ["dtype", "data", "codec", "ratio", "encode MB/s", "decode MB/s", "max rel err"],
            codec_rows,
        ),
        table(
            "In-process handoff: KVWriter (encode + crc32) and KVAssembler (decode + crc32)",
            ["dtype", "codec", "cache MB", "send MB/s", "receive MB/s"],
            serde_rows,
        ),
    ]
    if args.json:
        write_json(args.json, bench_result("kv_codecs", tables, series))


if __name__ == "__main__":
    main()
