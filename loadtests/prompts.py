"""A realistic, offline mix of prompt lengths for load tests and benchmarks.

Three kinds, roughly as production chat traffic looks: many short chat turns,
some medium questions with context, a few long document-style prompts (those
dominate prefill time). Text is built from a fixed corpus with a seeded RNG, so
a run is reproducible and nothing is downloaded.

``MLXCEL_LOCUST_PROMPT_MIX="short:6,medium:3,long:1"`` (the default) sets the
weights; lengths are in words (SmolLM2's tokenizer gives ~1.3 tokens a word).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

DEFAULT_MIX = "short:6,medium:3,long:1"

# Word ranges per kind. "long" stays under ~1,300 tokens so prompt + output fits
# the tiny test model's 2,048-token context.
WORD_RANGES: dict[str, tuple[int, int]] = {
    "short": (6, 24),
    "medium": (120, 220),
    "long": (600, 950),
}

SHORT_QUESTIONS = (
    "What is the capital of France?",
    "Give me three tips for writing clean Python.",
    "How do I reverse a list in place?",
    "Explain what a KV cache is in one sentence.",
    "Write a haiku about autumn rain.",
    "What is the difference between TCP and UDP?",
    "Suggest a name for a small coffee shop.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Summarize the plot of Hamlet briefly.",
)

CORPUS = (
    "Large language models generate text one token at a time. The first step, "
    "prefill, reads the whole prompt and fills the attention cache; it is bound by "
    "compute. The second step, decode, produces tokens one by one and is bound by "
    "memory bandwidth. Splitting the two onto different machines lets each scale "
    "on its own, at the price of moving the cache between them. Operators care "
    "about the time to the first token, the gap between tokens, and how many "
    "requests per second meet both targets. The river wound through the valley, "
    "past orchards and stone bridges, while the village prepared for the harvest "
    "festival. Merchants set up stalls with bread, cheese and late summer fruit. "
    "In the afternoon a storm rolled in from the hills and the square emptied. "
    "Quarterly revenue grew eight percent, driven by subscriptions, while hardware "
    "margins narrowed because of component costs. The board approved a buyback and "
    "asked management to report on supply risks by the end of the year."
).split()

TASKS = (
    "Summarize the following text in three bullet points.",
    "List the key facts in the document below.",
    "Answer in one paragraph: what is the main point of this text?",
    "Rewrite the following passage for a ten-year-old reader.",
)


@dataclass(frozen=True)
class Prompt:
    """One request's input, usable as a chat turn or as a plain completion prompt."""

    kind: str
    system: str
    user: str

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.user}]

    def text(self) -> str:
        return f"{self.system}\n\n{self.user}\n\nAnswer:"


def parse_mix(spec: str) -> dict[str, float]:
    """``"short:6,medium:3,long:1"`` -> weights; unknown kinds are a clear error."""
    weights: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, _, weight = item.partition(":")
        if kind not in WORD_RANGES:
            raise ValueError(f"unknown prompt kind {kind!r}; known: {', '.join(WORD_RANGES)}")
        weights[kind] = float(weight or 1)
    if not weights or sum(weights.values()) <= 0:
        raise ValueError(f"prompt mix {spec!r} has no positive weight")
    return weights


def _document(rng: random.Random, words: int) -> str:
    # A rotating window over the corpus: varied text, no repeated-prefix cache hits.
    start = rng.randrange(len(CORPUS))
    return " ".join(CORPUS[(start + i) % len(CORPUS)] for i in range(words))


def make_prompt(kind: str, rng: random.Random) -> Prompt:
    low, high = WORD_RANGES[kind]
    words = rng.randint(low, high)
    system = "You are a helpful assistant."
    if kind == "short":
        return Prompt(kind, system, rng.choice(SHORT_QUESTIONS))
    return Prompt(kind, system, f"{rng.choice(TASKS)}\n\n{_document(rng, words)}")


def sample_prompt(rng: random.Random, mix: dict[str, float]) -> Prompt:
    kind = rng.choices(list(mix), weights=list(mix.values()))[0]
    return make_prompt(kind, rng)
