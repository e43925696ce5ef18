"""Prompts and probes for ``bench_speculative``: code edits, tool-call turns, open chat; the
time of a verify forward of several rows against a one-row decode step, and of a draft's
prefill of a long prompt (what a decode node spends instead of receiving the draft's K/V)."""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import json
import random
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from transformers import AutoTokenizer

from engines.decode_batch import vocab_head
from engines.model_loader import load_mlx_model
from engines.speculative.draft_batch import prefill_draft
from engines.speculative.verify import VERIFY_BLAS_THREADS
from mlxcel_plugin.openblas import mlx_blas_threads

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


# Standard-library modules whose code is varied enough that a small model copies it: on
# the generated, regular file this used to build, SmolLM2-135M wrote its own variations of
# the pattern instead (40% of prompt-lookup proposals accepted), not the file.
SOURCE_MODULES = ("textwrap", "fnmatch", "colorsys", "glob", "genericpath", "string", "shutil",
                  "sched", "tempfile", "reprlib", "linecache", "copy", "statistics", "difflib",
                  "posixpath", "random", "tokenize", "inspect", "ast", "csv", "argparse",
                  "logging", "functools", "contextlib", "mimetypes", "platform", "traceback",
                  "uuid", "warnings", "zipapp", "calendar", "pprint")
FILE_TOKENS = (1000, 1600)  # a code-edit prompt's file: at least, at most (SmolLM2's tokens)


def _top_level_blocks(source: str) -> list[tuple[str, str | None]]:
    """The module's top-level statements after its docstring: (source, its def's name)."""
    lines = source.splitlines(keepends=True)
    blocks = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and not blocks:
            continue  # the module docstring
        start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        name = node.name if isinstance(node, ast.FunctionDef | ast.ClassDef) else None
        blocks.append(("".join(lines[start - 1 : node.end_lineno]), name))
    return blocks


def source_file(tokenizer, module: str) -> tuple[str, str]:
    """A real module's first ``FILE_TOKENS`` tokens of code, whole statements, and a function or
    class defined in it (the one to rename)."""
    parts, functions, used = [], [], 0
    for block, name in _top_level_blocks(inspect.getsource(importlib.import_module(module))):
        size = len(tokenizer.encode(block, add_special_tokens=False))
        if used >= FILE_TOKENS[0]:
            break
        if used + size > FILE_TOKENS[1]:
            continue  # a class too long for the file: the statements after it
        parts.append(block)
        functions += [name] if name else []
        used += size
    if not functions:
        raise ValueError(f"{module}: no def in its first {FILE_TOKENS[1]} tokens")
    return "\n\n".join(parts), functions[len(functions) // 2]


def code_edit_prompts(tokenizer_dir: str, count: int) -> list[tuple[int, ...]]:
    """A Python file in the prompt, the reply asked to be the whole file with one rename."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = []
    for module in SOURCE_MODULES[:count]:
        source, function = source_file(tokenizer, module)
        ask = (f"Here is a Python file:\n\n```python\n{source}\n```\n\nRewrite the whole file "
               f"with `{function}` renamed to `{function}_v2`. Reply with the complete file "
               "only.")
        prompts.append(_chat(tokenizer, ask))
    return prompts


TOOL_SPEC = {"name": "write_file", "description": "Write a file in the workspace.",
             "parameters": {"type": "object", "properties": {
                 "path": {"type": "string"}, "content": {"type": "string"}},
                 "required": ["path", "content"]}}


def _tool_turn(seed: int) -> list[dict[str, str]]:
    """An agent turn: the tool, its last call (a config file), and a request to call it
    again with one value changed: the reply repeats the call's arguments."""
    rng = random.Random(seed)
    config = {f"option_{i}": rng.choice(["on", "off", rng.randint(1, 99)]) for i in range(12)}
    call = {"name": "write_file", "arguments": {"path": f"conf/service_{seed}.json",
                                                "content": json.dumps(config, indent=1)}}
    system = ("You can call this tool by replying with one JSON object "
              f"{{\"name\": ..., \"arguments\": ...}}:\n{json.dumps(TOOL_SPEC)}")
    return [{"role": "system", "content": system},
            {"role": "user", "content": f"Write the config for service {seed}."},
            {"role": "assistant", "content": json.dumps(call)},
            {"role": "user", "content": f"Call write_file again with option_{seed % 12} set "
             "to \"auto\" and everything else unchanged. Reply with the JSON call only."}]


def tool_call_prompts(tokenizer_dir: str, count: int) -> list[tuple[int, ...]]:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = []
    for seed in range(count):
        templated = tokenizer.apply_chat_template(_tool_turn(seed), add_generation_prompt=True,
                                                  tokenize=False)
        prompts.append(tuple(int(t) for t in tokenizer.encode(templated,
                                                              add_special_tokens=False)))
    return prompts


def chat_prompts(tokenizer_dir: str, count: int) -> list[tuple[int, ...]]:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    topics = (TOPICS * (count // len(TOPICS) + 1))[:count]
    return [_chat(tokenizer, f"Tell me something surprising about {topic}.") for topic in topics]


def _forward_s(model, cache, width: int) -> float:
    """A one-row step as plain decoding runs it; more rows as a verify does (one BLAS thread)."""
    inputs = mx.array([[17] * width], dtype=mx.uint32)
    threads = mlx_blas_threads(VERIFY_BLAS_THREADS) if width > 1 else contextlib.nullcontext()
    start = time.perf_counter()
    with threads:
        mx.eval(model(inputs, cache=cache))
    seconds = time.perf_counter() - start
    for layer in cache:
        layer.trim(width)
    return seconds


def verify_row_cost(model_path: str, context: int = 512, repeats: int = 30) -> dict[int, float]:
    """Time of a forward of 1..8 rows over ``context`` cached tokens, over a one-row step's
    (the widths interleaved, so a change of load weighs on each alike)."""
    model = load_mlx_model(model_path)[0]
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(100, 100 + context))], dtype=mx.uint32), cache=cache))
    widths = (1, 2, 3, 5, 8)
    times: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(repeats):
        for width in widths:
            times[width].append(_forward_s(model, cache, width))
    one = statistics.median(times[1])
    return {w: statistics.median(found) / one for w, found in times.items()}


def draft_prefill_s(model_path: str, tokens: int = 2048, repeats: int = 3) -> tuple[float, int]:
    """Median seconds of a draft's prefill of ``tokens`` tokens, and its K/V bytes."""
    model = load_mlx_model(model_path)[0]
    body_only = vocab_head(model) is not None  # as DraftBatch prefills
    prompt = [100 + (7 * i) % 4000 for i in range(tokens)]
    times, nbytes = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        caches = prefill_draft(model, prompt, body_only)
        times.append(time.perf_counter() - start)
        nbytes = sum(c.nbytes for c in caches)
    return statistics.median(times), int(nbytes)
