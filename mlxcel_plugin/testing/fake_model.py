"""What the ``fake`` engine computes, as pure functions (no thread, no queue).

Tokens are a pure function of (prompt, position, seed), so one node and two
agree. The cache encodes the prompt: layer ``l`` holds ``prompt[t] + l`` in
every K/V row of token ``t`` (float32, exact), and ``prompt_from_cache`` reads
it back, so a cache damaged in transit decodes different tokens (or is
refused) instead of passing silently.

Knobs come from ``fake_engine.json`` in the "model" directory (all optional)::

    {"num_layers": 4, "kv_heads": 2, "head_dim": 8, "prefill_s_per_token": 0.0,
     "decode_step_s": 0.0, "context_length": 4096}
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from mlxcel_plugin.engine_api import CacheLayer, CacheState, GenerationRequest
from mlxcel_plugin.errors import EngineError

CONFIG_FILE = "fake_engine.json"
EOS_TOKEN_ID = 2
# A prompt ending in this token makes the first generated token EOS (tests that path).
EOS_TRIGGER_TOKEN_ID = 1
VOCAB_SIZE = 1000
_FIRST_REGULAR_TOKEN = 3


@dataclass(frozen=True)
class FakeEngineSettings:
    num_layers: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    prefill_s_per_token: float = 0.0
    decode_step_s: float = 0.0
    context_length: int = 4096
    # Prompt ids up to this are accepted: a real tokenizer's vocabulary (the
    # router tokenizes with it), while generated ids stay below VOCAB_SIZE.
    input_vocab_size: int = VOCAB_SIZE

    @classmethod
    def from_dir(cls, model_dir: str | Path | None) -> FakeEngineSettings:
        if not model_dir:
            return cls()
        data = {"input_vocab_size": _checkpoint_vocab_size(Path(model_dir))}
        path = Path(model_dir) / CONFIG_FILE
        if path.is_file():
            data.update(json.loads(path.read_text()))
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _checkpoint_vocab_size(model_dir: Path) -> int:
    config = model_dir / "config.json"
    if not config.is_file():
        return VOCAB_SIZE
    return max(VOCAB_SIZE, int(json.loads(config.read_text()).get("vocab_size", VOCAB_SIZE)))


def next_token(prompt: tuple[int, ...], index: int, seed: int | None) -> int:
    """The completion token at ``index``: a pure function of prompt, position and seed."""
    if index == 0 and prompt and prompt[-1] == EOS_TRIGGER_TOKEN_ID:
        return EOS_TOKEN_ID
    mix = (sum(prompt) * 31 + len(prompt) * 17 + index * 7919 + (seed or 0) * 104729) % 2**31
    return _FIRST_REGULAR_TOKEN + mix % (VOCAB_SIZE - _FIRST_REGULAR_TOKEN)


def expected_tokens(
    request: GenerationRequest, eos_ids: tuple[int, ...] = (EOS_TOKEN_ID,)
) -> list[int]:
    """What ``generate`` emits for ``request`` (tests compare node output against this)."""
    tokens: list[int] = []
    seed = request.sampling.seed if not request.sampling.is_greedy else None
    for index in range(request.max_tokens):
        token = next_token(tuple(request.prompt_tokens), index, seed)
        tokens.append(token)
        if token in eos_ids or token in request.stop_token_ids:
            break
    return tokens


def make_layer(prompt: tuple[int, ...], layer: int, settings: FakeEngineSettings) -> CacheLayer:
    values = np.asarray(prompt, dtype=np.float32) + layer
    shape = (1, settings.kv_heads, len(prompt), settings.head_dim)
    keys = np.broadcast_to(values.reshape(1, 1, -1, 1), shape).copy()
    return CacheLayer("KVCache", keys, -keys, "float32", len(prompt))


def prompt_from_cache(cache: CacheState) -> tuple[int, ...]:
    """Read the prompt back; raises EngineError when layers disagree (a damaged cache)."""
    first = cache.layers[0].keys[0, 0, :, 0]
    for index, layer in enumerate(cache.layers):
        if not (np.all(layer.keys == first.reshape(1, 1, -1, 1) + index)
                and np.array_equal(layer.values, -layer.keys)):
            raise EngineError(f"fake cache layer {index} is inconsistent")
    return tuple(int(v) for v in first)


class FakePrefixStore:
    """The fake engine's prefix cache: the prompts it decoded, for delta handoffs.

    A fake cache is a pure function of the prompt, so holding a prompt is
    holding its K/V; ``splice`` rebuilds the pinned prefix's rows and puts
    them in front of a delta's. Thread-safe (pins come from a node's loop).
    """

    def __init__(self, enabled: bool = True, max_prompts: int = 64):
        self.enabled, self.max_prompts = enabled, max_prompts
        self._prompts: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self._pins: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    def keep(self, prompt: Sequence[int]) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._prompts[tuple(prompt)] = None
            self._prompts.move_to_end(tuple(prompt))
            while len(self._prompts) > self.max_prompts:
                self._prompts.popitem(last=False)

    def pin(self, request_id: str, tokens: Sequence[int], prefix_tokens: int) -> bool:
        prefix = tuple(tokens[:prefix_tokens])
        with self._lock:
            held = 0 < prefix_tokens < len(tokens) and any(
                p[:prefix_tokens] == prefix for p in self._prompts)
            if held:
                self._pins[request_id] = prefix
        return held

    def unpin(self, request_id: str) -> None:
        with self._lock:
            self._pins.pop(request_id, None)

    def splice(self, request_id: str, cache: CacheState,
               settings: FakeEngineSettings) -> CacheState:
        """``cache`` with the pinned prefix's rows in front (as is without a pin)."""
        with self._lock:
            prefix = self._pins.pop(request_id, None)
        if prefix is None:
            return cache
        layers = []
        for index, layer in enumerate(cache.layers):
            held = make_layer(prefix, index, settings)
            try:
                keys = np.concatenate([held.keys, layer.keys], axis=2)
                values = np.concatenate([held.values, layer.values], axis=2)
            except ValueError as exc:  # a delta of another shape: that request fails alone
                raise EngineError(f"layer {index} cannot take the pinned prefix: {exc}") from exc
            layers.append(dataclasses.replace(layer, keys=keys, values=values))
        return CacheState(layers)
