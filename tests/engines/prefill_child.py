"""A prefill node in its own process: ``python -m tests.engines.prefill_child MODEL OUT.npz``.

Reads a JSON request on stdin, prefills it with a fresh engine and writes the
first token and the per-layer K/V (raw numpy) to ``OUT.npz``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from engines.mlx_engine import MlxEngine
from mlxcel_plugin.engine_api import (
    CacheLayer,
    CacheState,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
)
from tests.engines import support


def save_result(path: Path, first_token: int, cache: CacheState) -> None:
    arrays = {"first_token": np.array(first_token)}
    header = []
    for i, layer in enumerate(cache.layers):
        arrays[f"k{i}"], arrays[f"v{i}"] = layer.keys, layer.values
        header.append(
            {"kind": layer.kind, "dtype": layer.dtype, "offset": layer.offset, "meta": layer.meta}
        )
    arrays["header"] = np.array(json.dumps(header))
    np.savez(path, **arrays)


def load_result(path: Path) -> tuple[int, CacheState]:
    data = np.load(path)
    header = json.loads(str(data["header"]))
    layers = [
        CacheLayer(h["kind"], data[f"k{i}"], data[f"v{i}"], h["dtype"], h["offset"], h["meta"])
        for i, h in enumerate(header)
    ]
    return int(data["first_token"]), CacheState(layers)


def request_from_json(raw: dict) -> GenerationRequest:
    return GenerationRequest(
        request_id=raw["request_id"],
        prompt_tokens=tuple(raw["prompt_tokens"]),
        max_tokens=raw["max_tokens"],
        sampling=SamplingParams.from_dict(raw["sampling"]),
    )


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    raw = json.loads(sys.stdin.read())
    engine = MlxEngine.from_path(model, EngineConfig(chunk_size_tokens=raw["chunk_size_tokens"]))
    engine.start()
    result = support.prefill(engine, request_from_json(raw))
    engine.close()
    save_result(out, result.first_token, result.cache)


if __name__ == "__main__":
    main()
