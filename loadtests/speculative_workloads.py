"""Prompts and a cost probe for ``bench_speculative``: code edits, open chat, and the time of
a verify forward of several rows against a one-row decode step."""

from __future__ import annotations

import random
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from transformers import AutoTokenizer

from engines.model_loader import load_mlx_model

TOPICS = [
    "the moon", "bread baking", "volcanoes", "chess openings", "honey bees", "glaciers",
    "the printing press", "octopuses", "solar panels", "jazz", "coral reefs", "bicycles",
    "the Roman roads", "tea", "lighthouses", "origami", "migratory birds", "paper money",
    "deserts", "the telescope", "rainbows", "silk", "sourdough", "tides", "windmills",
    "elephants", "the compass", "maple syrup", "thunderstorms", "typewriters", "mosses",
    "the violin",
]


def _chat(tokenizer, text: str) -> tuple[int, ...]:
    messages = [{"role": "user", "content": text}]
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=False)
    return tuple(int(t) for t in tokenizer.encode(templated, add_special_tokens=False))


def python_file(seed: int, functions: int = 14) -> str:
    """A small, plausible module: numbered helper functions with bodies that vary."""
    rng = random.Random(seed)
    parts = [f'"""Helpers for report {seed}."""\n\nimport math\n']
    for i in range(functions):
        op, k = rng.choice(["+", "-", "*"]), rng.randint(2, 9)
        parts.append(
            f"\n\ndef step_{i}(value, scale={k}):\n"
            f'    """Step {i}: scale the value and round it."""\n'
            f"    result = value {op} scale * {i + 1}\n"
            f"    return round(math.fabs(result), {rng.randint(1, 4)})\n")
    return "".join(parts)


def code_edit_prompts(tokenizer_dir: str, count: int) -> list[tuple[int, ...]]:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = []
    for seed in range(count):
        source = python_file(seed)
        ask = (f"Here is a Python file:\n\n```python\n{source}```\n\nRewrite the whole file "
               f"with `step_{seed % 10}` renamed to `stage_{seed % 10}`. Reply with the "
               "complete file only.")
        prompts.append(_chat(tokenizer, ask))
    return prompts


def chat_prompts(tokenizer_dir: str, count: int) -> list[tuple[int, ...]]:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    topics = (TOPICS * (count // len(TOPICS) + 1))[:count]
    return [_chat(tokenizer, f"Tell me something surprising about {topic}.") for topic in topics]


def _forward_s(model, cache, width: int, repeats: int) -> float:
    inputs = mx.array([[17] * width], dtype=mx.uint32)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(model(inputs, cache=cache))
        times.append(time.perf_counter() - start)
        for layer in cache:
            layer.trim(width)
    return statistics.median(times)


def verify_row_cost(model_path: str, context: int = 512, repeats: int = 30) -> dict[int, float]:
    """Time of a forward of 1..8 rows over ``context`` cached tokens, over a one-row step's."""
    model = load_mlx_model(model_path)[0]
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(100, 100 + context))], dtype=mx.uint32), cache=cache))
    one = _forward_s(model, cache, 1, repeats)
    return {w: _forward_s(model, cache, w, repeats) / one for w in (1, 2, 3, 5, 8)}
