"""KV codec throughput and size ratios on synthetic KV, plus in-process serde throughput.

Numpy only (no MLX): the cache is shaped like SmolLM2-135M's (30 layers, 3 KV
heads, head_dim 64), or with ``--shape 8b`` like an 8B model's (8 KV heads,
head_dim 128, bf16; ``--layers`` of them, default 4), filled with
per-channel-scaled Gaussian noise (the pessimistic case: no lossless codec
shrinks it) or smooth per-channel sinusoids (RoPE-like; byte-plane shuffling
then helps LZ4). Each codec runs on the writer's real chunks (``--chunk-mib``)
with the layout the writer passes (K or V, tokens per head, first row), so
figures include per-chunk overheads; decoding writes into reused buffers, as a
receiver's ``decode_into`` does. Max rel err is the worst |error| over the
larger of its row's and column's max |x| (int8/int4 keys are grouped along
tokens, per channel); rel MSE is the squared error over the squared values.
CPU-s/GiB is this process's CPU time per GiB of raw KV, with NumPy's BLAS at
one thread as nodes run it (``openblas.limit_numpy_blas``; its worker threads
would otherwise spin on a second core).

``--rotation-blocks 16,32,64`` adds int8 rows rotated in at most that block
(``int8/h64``: what encoders before blocks of 16 sent). ``--stages`` profiles
int8's encode and decode per function (CPU-s/GiB spent in each).

``transcode_cache`` (a cache through a codec and back, as a decode node would
receive it) is the hook for the real-model agreement benchmark: prefill with
the engine, transcode, decode, compare tokens with the untouched cache.

Usage: python loadtests/bench_kv_codecs.py [--quick] [--json PATH] [--tokens 2048]
       [--shape smollm2|8b] [--layers N] [--codecs int8,...] [--rotation-blocks 16,64]
       [--stages]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from bench_common import add_common_args, bench_result, table, write_json

from mlxcel_plugin import openblas
from mlxcel_plugin.builtin_plugin import builtin_codecs
from mlxcel_plugin.engine_api import CacheState
from mlxcel_plugin.kv_codecs import (
    ChunkLayout,
    GroupQuantCodec,
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
GIB = float(1 << 30)
CODEC_NAMES = ["none", "lz4", "shuffle+lz4", "int8", "int8+lz4", "int4"]
CODECS = builtin_codecs()
SHAPES = {"smollm2": (30, 3, 64), "8b": (32, 8, 128)}  # layers, KV heads, head_dim


def transcode_cache(cache: CacheState, fingerprint: ModelFingerprint, codec: str) -> CacheState:
    """The cache a decode node would hold after a handoff with ``codec``."""
    tokens = cache.layers[0].offset
    header = make_header(fingerprint, tokens, codec=codec)
    messages = SerializableCacheState(header, cache).to_messages(resolve_codec(codec, CODECS))
    return assemble_messages(messages, fingerprint, CODECS).cache


def best_time(action: Callable[[], object], repeats: int,
              clock: Callable[[], float] = time.perf_counter) -> float:
    times = []
    for _ in range(repeats):
        start = clock()
        action()
        times.append(clock() - start)
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


def squared_error(chunks: list[Chunk], decoded: list[np.ndarray], dtype: str) -> float:
    """Sum of squared errors over the sum of squared values."""
    error = signal = 0.0
    for (chunk, _), out in zip(chunks, decoded, strict=True):
        want = to_float32(chunk, dtype)
        error += float(np.square(to_float32(out, dtype) - want).sum())
        signal += float(np.square(want).sum())
    return error / signal if signal else 0.0


def decoder(codec: KVCodec, chunks: list[Chunk], encoded: list, dtype: str):
    """A function decoding every chunk (into reused buffers where the codec can), and them."""
    outs = [np.empty(chunk.shape, dtype=chunk.dtype) for chunk, _ in chunks]
    into = getattr(codec, "decode_into", None)

    def decode_all() -> list[np.ndarray]:
        for (body, meta), (chunk, _), out in zip(encoded, chunks, outs, strict=True):
            if into is not None:
                into(body, meta, out.reshape(-1, chunk.shape[-1]), dtype)
            else:
                out[...] = codec.decode(body, meta, chunk.shape, dtype)
        return outs

    return decode_all


def codec_figures(codec: KVCodec, chunks: list[Chunk], dtype: str, repeats: int) -> dict:
    raw = sum(chunk.nbytes for chunk, _ in chunks)

    def encode_all() -> list:
        return [codec.encode(chunk, dtype, layout) for chunk, layout in chunks]

    encoded = encode_all()
    encode_cpu = best_time(encode_all, repeats, time.process_time)
    encode_s = best_time(encode_all, repeats)
    decode_all = decoder(codec, chunks, encoded, dtype)
    decode_all()
    decode_cpu = best_time(decode_all, repeats, time.process_time)
    decode_s = best_time(decode_all, repeats)
    figures = {
        "ratio": raw / sum(len(body) for body, _ in encoded),
        "encode_mb_s": raw / encode_s / MB,
        "decode_mb_s": raw / decode_s / MB,
        "encode_cpu_s_gib": encode_cpu / (raw / GIB),
        "decode_cpu_s_gib": decode_cpu / (raw / GIB),
        "max_rel_error": 0.0,
        "rel_mse": 0.0,
    }
    if not codec.lossless:
        decoded = decode_all()
        figures["max_rel_error"] = max(
            relative_error(chunk, out, dtype) for (chunk, _), out in zip(chunks, decoded,
                                                                          strict=True)
        )
        figures["rel_mse"] = squared_error(chunks, decoded, dtype)
    return figures


def stage_profile(codec: KVCodec, chunks: list[Chunk], dtype: str) -> list[list]:
    """CPU-s/GiB spent in each of the codec package's functions (own time), encode and
    decode apart: where int8's time goes."""
    raw = sum(chunk.nbytes for chunk, _ in chunks) / GIB
    encoded = [codec.encode(chunk, dtype, layout) for chunk, layout in chunks]
    decode_all = decoder(codec, chunks, encoded, dtype)
    rows = []
    for side, action in (("encode", lambda: [codec.encode(c, dtype, lay) for c, lay in chunks]),
                         ("decode", decode_all)):
        profile = cProfile.Profile(time.process_time)
        profile.runcall(action)
        stats = pstats.Stats(profile).stats
        total = sum(entry[2] for entry in stats.values())
        top = sorted(stats.items(), key=lambda item: -item[1][2])[:10]
        for (path, line, name), entry in top:
            where = f"{Path(path).stem}.{name}" if line else name
            rows.append([side, where, round(entry[2] / raw, 3), f"{entry[2] / total:.0%}"])
        rows.append([side, "(all)", round(total / raw, 3), "100%"])
    return rows


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


def codecs_to_run(args: argparse.Namespace) -> dict[str, KVCodec]:
    names = args.codecs.split(",") if args.codecs else CODEC_NAMES
    codecs = {name: resolve_codec(name, CODECS) for name in names}
    for block in filter(None, args.rotation_blocks.split(",")):
        codecs[f"int8/h{block}"] = GroupQuantCodec(8, rotation_cap=int(block))
    return codecs


def parse_args() -> argparse.Namespace:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens in the cache")
    parser.add_argument("--chunk-mib", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--layers", type=int, help="layers of the shape (8b: default 4)")
    parser.add_argument("--dtypes", help="comma-separated (default: all three; 8b: bfloat16)")
    parser.add_argument("--data", default="noise,smooth", help="noise, smooth or both")
    parser.add_argument("--codecs", help=f"comma-separated (default: {','.join(CODEC_NAMES)})")
    parser.add_argument("--rotation-blocks", default="", help="int8 variants, e.g. 16,32,64")
    parser.add_argument("--stages", action="store_true", help="int8's CPU time per function")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    capped = openblas.limit_numpy_blas(1)
    print(f"NumPy's BLAS capped at one thread ({capped} librar{'y' if capped == 1 else 'ies'})")
    tokens = 256 if args.quick else args.tokens
    repeats = 1 if args.quick else args.repeats
    chunk_bytes = int(args.chunk_mib * (1 << 20))
    layers, heads, head_dim = SHAPES[args.shape]
    layers = args.layers or (4 if args.shape == "8b" else layers)
    dtypes = args.dtypes or ("bfloat16" if args.shape == "8b" else "float16,bfloat16,float32")
    codecs = codecs_to_run(args)

    codec_rows, serde_rows, stage_rows = [], [], []
    series: dict[str, list[float]] = {}
    for dtype in dtypes.split(","):
        fingerprint = make_fingerprint(layers, heads, head_dim, dtype)
        for data in args.data.split(","):
            cache = make_cache(fingerprint, tokens, seed=1, smooth=data == "smooth")
            chunks = chunks_of(cache, fingerprint.head_dim, chunk_bytes)
            for name, codec in codecs.items():
                fig = codec_figures(codec, chunks, dtype, repeats)
                codec_rows.append([
                    dtype, data, name, round(fig["ratio"], 3), round(fig["encode_mb_s"]),
                    round(fig["decode_mb_s"]), round(fig["encode_cpu_s_gib"], 3),
                    round(fig["decode_cpu_s_gib"], 3), f"{fig['max_rel_error']:.4f}",
                    f"{fig['rel_mse']:.3e}",
                ])
                series.setdefault(f"ratio_{name}", []).append(fig["ratio"])
                print(" ".join(f"{cell!s:>12}" for cell in codec_rows[-1]), flush=True)
            if args.stages:
                stage_rows += [[dtype, data, *row] for row in
                               stage_profile(resolve_codec("int8", CODECS), chunks, dtype)]
        if args.shape == "smollm2":
            for name in ("none", "lz4"):
                send, receive = serde_figures(fingerprint, cache, name, chunk_bytes, repeats)
                serde_rows.append(
                    [dtype, name, round(cache.nbytes / MB, 1), round(send), round(receive)]
                )
                print("serde", " ".join(f"{cell!s:>10}" for cell in serde_rows[-1]), flush=True)

    tables = [
        table(
            f"Codecs on synthetic KV ({tokens} tokens, {layers} layers x {heads} heads x "
            f"{head_dim}, {args.chunk_mib} MiB chunks; MB/s and CPU-s per GiB of raw bytes)",
            ["dtype", "data", "codec", "ratio", "encode MB/s", "decode MB/s",
             "encode CPU-s/GiB", "decode CPU-s/GiB", "max rel err", "rel MSE"],
            codec_rows,
        ),
    ]
    if serde_rows:
        tables.append(table(
            "In-process handoff: KVWriter (encode + crc32) and KVAssembler (decode + crc32)",
            ["dtype", "codec", "cache MB", "send MB/s", "receive MB/s"],
            serde_rows,
        ))
    if stage_rows:
        tables.append(table(
            "int8 per function (own CPU time, process clock)",
            ["dtype", "data", "side", "function", "CPU-s/GiB", "share"], stage_rows,
        ))
        for row in stage_rows:
            print("stage", " ".join(f"{cell!s:>10}" for cell in row))
    if args.json:
        write_json(args.json, bench_result("kv_codecs", tables, series))


if __name__ == "__main__":
    main()
