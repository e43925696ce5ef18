"""Structured output's cost per token: the grammar mask alone, and a whole decode with it.

1. *Mask*: a ``GrammarConstraint`` (engines/grammar.py) driven over random
   logits rows of the model's vocabulary: the time of ``mask`` (llguidance's
   bitmask, unpacked, applied to the row) and ``advance`` per token, per schema,
   next to greedy sampling's own cost on the same row.
2. *Decode*: the MLX engine generating ``--tokens`` tokens from one prompt,
   unconstrained and under a schema that never closes (one unbounded string),
   so both runs produce the same number of tokens; the difference per token is
   what a request pays for its grammar on this machine (one sequence, so
   nothing hides it behind other sequences' work).

Usage: python loadtests/bench_structured.py [--quick] [--json PATH] [--model DIR] [--tokens N]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
from bench_common import add_common_args, bench_result, table, write_json

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engines.grammar import grammar_tokenizer, request_constraint  # noqa: E402
from engines.model_store import ensure_default_model, ensure_tiny_model  # noqa: E402
from engines.sampling import sample_from_logits  # noqa: E402
from mlxcel_plugin.engine_api import (  # noqa: E402
    EngineConfig,
    GenerationRequest,
    ModelInfo,
    SamplingParams,
)
from mlxcel_plugin.structured_output import parse_response_format  # noqa: E402

OPEN_STRING = {"type": "object", "properties": {"text": {"type": "string"}},
               "required": ["text"], "additionalProperties": False}
SCHEMAS = {
    "json_object": None,
    "one_string": OPEN_STRING,
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
               "properties": {"name": {"type": "string", "maxLength": 40},
                              "age": {"type": "integer", "minimum": 0, "maximum": 150},
                              "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}}},
}


def spec(schema: dict | None) -> str:
    if schema is None:
        return parse_response_format({"type": "json_object"})
    return parse_response_format({"type": "json_schema", "json_schema": {
        "name": "bench", "schema": schema, "strict": True}})


def model_info(model_dir: Path) -> ModelInfo:
    from engines.model_loader import eos_token_ids, load_mlx_model
    from engines.model_loader import model_info as loaded_info

    model, config = load_mlx_model(str(model_dir))
    info = loaded_info(model_dir, model, config)
    return dataclasses.replace(info, eos_token_ids=eos_token_ids(model_dir, config))


def mask_costs(info: ModelInfo, tokens: int) -> list[list]:
    """Median and p99 us per token of mask, advance and greedy sampling, per schema."""
    rows, rng = [], np.random.default_rng(0)
    started = time.perf_counter()
    grammar_tokenizer(info.tokenizer_dir, info.vocab_size, info.eos_token_ids[0])
    rows.append(["(tokenizer, once per model)", 0, round((time.perf_counter() - started) * 1e3, 1),
                 *[""] * 6])
    for name, schema in SCHEMAS.items():
        request = GenerationRequest(name, (1, 2, 3), tokens, SamplingParams(grammar=spec(schema)))
        started = time.perf_counter()
        constraint = request_constraint(request, info)
        compile_ms = (time.perf_counter() - started) * 1e3
        masks, advances, samples = [], [], []
        for _ in range(tokens):
            logits = rng.standard_normal(info.vocab_size).astype(np.float32)
            t0 = time.perf_counter()
            masked = constraint.mask(logits)
            t1 = time.perf_counter()
            token = sample_from_logits(masked, SamplingParams(), rng)
            t2 = time.perf_counter()
            if token in info.eos_token_ids:
                break
            constraint.advance(token)
            advances.append(time.perf_counter() - t2)
            masks.append(t1 - t0)
            samples.append(t2 - t1)
        rows.append([name, len(masks), round(compile_ms, 2), *us(masks), *us(advances),
                     *us(samples)])
    return rows


def us(values: list[float]) -> list[float]:
    ordered = sorted(values)
    return [round(statistics.median(ordered) * 1e6, 1),
            round(ordered[int(0.99 * (len(ordered) - 1))] * 1e6, 1)]


def decode_costs(model_dir: Path, tokens: int, repeats: int) -> list[list]:
    """Per-token ms of one sequence's decode, unconstrained and under ``one_string``."""
    from engines.mlx_engine import MlxEngine

    engine = MlxEngine.from_path(str(model_dir), EngineConfig())
    engine.start()
    try:
        rows = []
        for label, grammar in (("none", None), ("one_string", spec(OPEN_STRING))):
            times = []
            for i in range(repeats):
                params = SamplingParams(grammar=grammar)
                request = GenerationRequest(f"{label}{i}", tuple(range(10, 42)), tokens, params)
                started = time.perf_counter()
                count = generated_tokens(engine, request)
                times.append((time.perf_counter() - started) / max(1, count))
            rows.append([label, tokens, round(min(times) * 1e3, 3),
                         round(statistics.median(times) * 1e3, 3)])
        return rows
    finally:
        engine.close()


def generated_tokens(engine, request: GenerationRequest, timeout_s: float = 1800.0) -> int:
    """Run one request to its end; how many tokens it produced."""
    done, tokens = threading.Event(), []

    def emit(event) -> None:
        if event.token_id is not None:
            tokens.append(event.token_id)
        if event.finish_reason is not None:
            done.set()

    engine.generate(request, emit)
    if not done.wait(timeout_s):
        raise TimeoutError(f"{request.request_id} did not finish in {timeout_s} s")
    return len(tokens)


def main(argv: list[str] | None = None) -> int:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--model", type=Path, help="checkpoint (default: SmolLM2-135M)")
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args(argv)
    model_dir = args.model or (ensure_tiny_model() if args.quick else ensure_default_model())
    tokens = 32 if args.quick else args.tokens
    info = model_info(model_dir)
    masks = table(f"grammar mask per token ({model_dir.name}, vocab {info.vocab_size})",
                  ["schema", "tokens", "compile ms", "mask us p50", "mask us p99",
                   "advance us p50", "advance us p99", "greedy sample us p50",
                   "greedy sample us p99"], mask_costs(info, tokens))
    decode = table(f"decode, one sequence ({model_dir.name})",
                   ["grammar", "max tokens", "ms/token best", "ms/token median"],
                   decode_costs(model_dir, tokens, 2 if args.quick else 3))
    from bench_common import format_table

    for result_table in (masks, decode):
        print(format_table(result_table), end="\n\n")
    if args.json:
        write_json(args.json, bench_result("structured", [masks, decode]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
