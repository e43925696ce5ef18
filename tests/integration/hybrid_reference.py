"""Reference tokens from the engine's single-process ``generate`` (the hybrid path).

``python -m tests.integration.hybrid_reference MODEL [CHUNK_SIZE_TOKENS]`` reads a JSON list of
requests on stdin and prints a JSON map request_id -> tokens. It runs in its
own process with the same BLAS preload as the nodes, so the numbers match.
"""

from __future__ import annotations

import json
import sys

from engines.mlx_engine import MlxEngine
from mlxcel_plugin.engine_api import EngineConfig, GenerationRequest, SamplingParams
from tests.engines import support


def main() -> None:
    chunk = int(sys.argv[2]) if len(sys.argv) > 2 else EngineConfig.chunk_size_tokens
    engine = MlxEngine.from_path(sys.argv[1], EngineConfig(warmup=False, chunk_size_tokens=chunk))
    engine.start()
    tokens = {}
    try:
        for item in json.load(sys.stdin):
            request = GenerationRequest(item["request_id"], tuple(item["prompt"]),
                                        item["max_tokens"],
                                        SamplingParams.from_dict(item.get("sampling", {})))
            tokens[request.request_id] = support.generate(engine, request).tokens
    finally:
        engine.close()
    print(json.dumps(tokens))


if __name__ == "__main__":
    main()
