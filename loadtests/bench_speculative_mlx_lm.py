"""``mlx_lm server`` plain and with ``--draft-model`` on bench_speculative's prompts.

The prompts go as text to its ``/v1/completions`` (decoded from the same token ids,
greedy), streamed; per-stream decode tokens/s counts the reply's tokens (re-encoded)
after the first chunk over the time from the first chunk to the last.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from loadtests.bench_common import start_mlx_lm_server

NUM_DRAFT_TOKENS = 4  # as [speculative] num_speculative_tokens' default


def streamed_tok_s(url: str, text: str, max_tokens: int, tokenizer) -> float:
    body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    times, pieces = [], []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=900) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice.get("text"):
                times.append(time.perf_counter())
                pieces.append(choice["text"])
    tokens = len(tokenizer.encode("".join(pieces), add_special_tokens=False))
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    return (tokens - 1) / span if span > 0 else 0.0


def waves(url: str, texts: list[str], max_tokens: int, streams: int, tokenizer) -> list[float]:
    """Every text, ``streams`` at a time; each request's decode tok/s."""
    speeds = [0.0] * len(texts)

    def one(i: int) -> None:
        speeds[i] = streamed_tok_s(url, texts[i], max_tokens, tokenizer)

    for start in range(0, len(texts), streams):
        threads = [threading.Thread(target=one, args=(i,))
                   for i in range(start, min(start + streams, len(texts)))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return speeds


def mlx_lm_rows(model: str, draft: str, prompts: dict[str, list[tuple[int, ...]]],
                max_tokens: int, streams: list[int]) -> list[list]:
    """Rows like bench_speculative's: workload, streams, mode, tok/s, -, -, -."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    variants = {"mlx_lm": [], "mlx_lm-draft": ["--draft-model", draft,
                                               "--num-draft-tokens", str(NUM_DRAFT_TOKENS)]}
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for mode, extra in variants.items():
            server = start_mlx_lm_server(model, Path(work), extra_args=extra)
            try:
                for name, batch in prompts.items():
                    texts = [tokenizer.decode(list(p)) for p in batch]
                    for n in streams:
                        speeds = waves(server.url, texts, max_tokens, n, tokenizer)
                        rows.append([name, n, mode, round(statistics.median(speeds), 2),
                                     "-", "-", "-"])
                        print("  ", *rows[-1], flush=True)
            finally:
                server.stop()
    return rows
