"""The contract between the serving layers and an engine (MLX or third-party).

Engines speak token ids only; text belongs to the HTTP front. Every engine
method is thread-safe and non-blocking: work is queued to the engine's own
thread, and results come back through callbacks *called on that thread*
(async callers hop back with ``loop.call_soon_threadsafe``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import numpy as np

from mlxcel_plugin.logprobs import PromptLogprobs, TokenLogprobs
from mlxcel_plugin.speculative.settings import SpeculativeConfig, SpeculativeStats

FINISH_STOP = "stop"  # EOS or a stop token id
FINISH_LENGTH = "length"  # max_tokens reached
FINISH_CANCELLED = "cancelled"
FINISH_ERROR = "error"


def _from_known_fields(cls: type, data: dict[str, Any]) -> Any:
    """Build a dataclass ignoring unknown keys (newer peers) and defaulting missing ones."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Seeded sampling is a pure function of (seed, position): same tokens on one node or two.
    seed: int | None = None
    # Not sampling, but asked per request and carried with it (mlxcel_plugin/logprobs.py):
    # report each generated token's logprob and this many alternatives (None: none) ...
    logprobs: int | None = None
    # ... and the prompt tokens' (positions 1..n-1), computed without prefix reuse.
    prompt_logprobs: int | None = None
    # Constrained decoding (mlxcel_plugin/structured_output.py): the grammar spec's JSON
    # text, and how many of the prompt's last tokens were generated under it (a request
    # that migrated mid-stream): a node's fresh matcher consumes them first.
    grammar: str | None = None
    grammar_replay_tokens: int = 0
    # Speculative decoding for this request ("off" | "ngram"); None: the node's setting
    # (mlxcel_plugin/speculative/settings.py). Not sampling either, but it travels with it.
    speculative: str | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    def to_dict(self) -> dict[str, Any]:
        # Every field is a scalar: a shallow copy equals asdict(), without its recursion
        # (this runs twice per routed request, on the way to the first token).
        data = dict(self.__dict__)
        # Absent means None: a request without logprobs keeps the bytes it always had.
        if data["logprobs"] is None:
            del data["logprobs"]
        if data["prompt_logprobs"] is None:
            del data["prompt_logprobs"]
        if data["grammar"] is None:
            del data["grammar"]
        if not data["grammar_replay_tokens"]:
            del data["grammar_replay_tokens"]
        if data["speculative"] is None:
            del data["speculative"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        return _from_known_fields(cls, data)


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Extra stop ids on top of the model's EOS ids.
    stop_token_ids: tuple[int, ...] = ()
    # The LoRA adapter the request runs with (engines/lora); None: the base model.
    adapter: str | None = None
    # The client's ``prompt_cache_key``: a routing hint for the router's prefix-aware
    # balancer (requests with one key prefer one node); engines ignore it.
    cache_key: str | None = None


@dataclass(frozen=True)
class TokenEvent:
    """One generated token, or the terminal event of a request.

    ``index`` is the position in the completion (0 = first generated token).
    A terminal event has ``finish_reason`` set; its ``token_id`` is None only
    when no token came with it (cancel, error).
    """

    request_id: str
    index: int
    token_id: int | None
    finish_reason: str | None = None
    error: str | None = None
    # On the first event (index 0): prompt tokens whose K/V came from a prefix cache.
    cached_tokens: int = 0
    # With ``token_id`` when the request asked ``sampling.logprobs``.
    logprobs: TokenLogprobs | None = None
    # On the first event, when the request asked ``sampling.prompt_logprobs``.
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    # architecture, num_layers, dtype, cache_classes and layers (one per handoff layer),
    # kv_heads/head_dim for uniform K/V models: mlxcel_plugin/kv_serde/header.py
    fingerprint: dict[str, Any]
    context_length: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    tokenizer_dir: str = ""  # holds tokenizer.json (engines/grammar.py); "": none known


@dataclass
class CacheLayer:
    """One handoff layer of one sequence: a cache's arrays, K/V sliced to ``offset`` tokens.

    ``keys``/``values`` are ``[1, kv_heads, T, head_dim]`` numpy arrays (MLA
    caches: K and V of different widths); other arrays (SSM state, quantized
    scales and biases) sit in ``extra`` by the names the model's fingerprint
    gives them (``layers``: see mlxcel_plugin/kv_serde/layer_spec.py and
    docs/architectures.md); a layer without K/V leaves them None. bfloat16
    travels as a ``uint16`` view with ``dtype == "bfloat16"``. A layer that an
    engine's ``adopt_layer`` returned holds that engine's own arrays instead
    (same shape and storage dtype), which only that engine reads.
    """

    kind: str  # the engine's cache class name: "KVCache", "RotatingKVCache", "ArraysCache", ...
    keys: np.ndarray | Any
    values: np.ndarray | Any
    dtype: str
    offset: int  # prompt positions the layer has seen (fixed-size state: the prompt's length)
    meta: dict[str, Any] = field(default_factory=dict)  # e.g. RotatingKVCache max_size/keep/idx
    extra: dict[str, Any] = field(default_factory=dict)  # arrays beyond K/V, by name

    def array(self, name: str) -> Any:
        """The array a layer spec names: "k", "v", or one of ``extra``."""
        if name == "k":
            return self.keys
        if name == "v":
            return self.values
        return self.extra.get(name)

    def arrays(self) -> dict[str, Any]:
        """Every array the layer holds, by name."""
        held = {"k": self.keys, "v": self.values, **self.extra}
        return {name: array for name, array in held.items() if array is not None}

    @classmethod
    def of_arrays(cls, kind: str, arrays: dict[str, Any], dtype: str, offset: int,
                  meta: dict[str, Any] | None = None) -> CacheLayer:
        extra = {name: a for name, a in arrays.items() if name not in ("k", "v")}
        return cls(kind, arrays.get("k"), arrays.get("v"), dtype, offset, dict(meta or {}), extra)

    @property
    def nbytes(self) -> int:
        return int(sum(array.nbytes for array in self.arrays().values()))


@dataclass
class CacheState:
    layers: list[CacheLayer]

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


@dataclass
class PrefillResult:
    request: GenerationRequest
    first_token: int
    cache: CacheState
    # Set when the first token already ends the request (EOS, or max_tokens == 1).
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    logprobs: TokenLogprobs | None = None  # the first token's, when asked
    prompt_logprobs: PromptLogprobs | None = None  # when asked


@dataclass(frozen=True)
class PrefixCacheStats:
    hit_tokens: int = 0  # prompt tokens served from the cache (counter)
    lookup_tokens: int = 0  # prompt tokens looked up (counter)
    cached_bytes: int = 0  # bytes held now (gauge)
    entries: int = 0
    evictions: int = 0  # entries dropped to stay in budget (counter)
    capacity_bytes: int = 0  # the cache's bound; 0: the engine keeps no prefixes
    # Any prompt token is reused exactly when a forward has at least this many rows;
    # 0: whole chunks only (engines/prefix/grid.py, engines/prefix/reuse_probe.py).
    exact_min_rows: int = 0


@dataclass(frozen=True)
class EngineStats:
    queued: int = 0
    active_sequences: int = 0
    kv_bytes: int = 0  # everything held, the prefix cache included
    free_kv_fraction: float = 1.0
    tokens_per_s: float = 0.0
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    speculative: SpeculativeStats = field(default_factory=SpeculativeStats)


@dataclass(frozen=True)
class PrefixCacheConfig:
    """``[prefix_cache]``: prompt KV kept across requests (docs/prefix-cache.md)."""

    # Inside ``kv_memory_bytes``; entries are evicted before a request is refused. 0: off.
    max_bytes: int = 1024**3
    # Also reuse what decode computed (the reply): faster turns, not byte-identical.
    reuse_generated: bool = False
    # "auto": reuse any prefilled token where the engine's start-up probe finds that exact
    # (engines/prefix/reuse_probe.py), else whole chunks; "chunk": whole chunks only, no probe.
    # Every node of a cluster must resolve it alike (the same kind of machine).
    granularity: str = "auto"
    # Router: a decode node believed to hold all but at most this many prompt tokens
    # prefills them itself, without a prefill node (0: always use a prefill node).
    local_prefill_tokens: int = 256


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 32
    max_sequences: int = 128
    # Prefill chunk size; hybrid and prefill roles share it so results stay byte-exact.
    chunk_size_tokens: int = 128
    memory_threshold: float = 0.85
    # 0: sized from the model and the machine's memory (mlxcel_plugin/memory_budget.py).
    kv_memory_bytes: int = 0
    # Decode node: freed receive buffers kept faulted in for the next handoffs (MLX's cache
    # limit; docs/bulk-lanes.md#receive-pool); 0: auto, at most 2 GiB; never above
    # kv_memory_bytes.
    receive_pool_bytes: int = 0
    # K/V kept quantized to this many bits once a prompt is prefilled (engines/kv_quant.py;
    # mlx-lm's kv_bits); 0: off. Prefill and decode nodes must agree.
    kv_bits: int = 0
    kv_group_size: int = 64
    warmup: bool = True
    prefix_cache: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # LoRA adapters served at start, "NAME=PATH[@BASE]" (--adapter; mlxcel_plugin/adapter_specs).
    adapters: tuple[str, ...] = ()
    # Adapters may be loaded at run time (POST /v1/load_lora_adapter), as vLLM's --enable-lora.
    enable_lora: bool = False


EmitToken = Callable[[TokenEvent], None]
LayerReady = Callable[[int, CacheLayer], None]
# (layer index, first token, {"k", "v"}: numpy [1, kv_heads, n, head_dim]): one prefill cell's
# rows of one plain KVCache layer, final once its forward is evaluated.
RowsReady = Callable[[int, int, dict[str, Any]], None]
PrefillDone = Callable[[PrefillResult | Exception], None]
# A received (numpy) layer in, the same layer in the engine's own arrays out; see
# ``Engine.adopt_layer``.
LayerAdopter = Callable[[CacheLayer], CacheLayer]
# (shape, numpy storage dtype, count) -> ``count`` writable C-contiguous numpy views of
# fresh engine memory; see ``Engine.kv_buffers``.
KVBufferMaker = Callable[[tuple[int, ...], np.dtype, int], list[np.ndarray]]
# (request_id, prompt tokens, prefix_tokens) -> True once the prefix is pinned; see
# ``Engine.reserve_prefix``.
PrefixReserver = Callable[[str, Sequence[int], int], bool]


def layer_adopter(engine: object) -> LayerAdopter | None:
    """The engine's ``adopt_layer``, or None for an engine that decodes from numpy as is."""
    return getattr(engine, "adopt_layer", None)


def prefill_rows(engine: object) -> bool:
    """Whether ``engine.prefill`` takes ``on_rows`` (each cell's K/V after its forward)."""
    return bool(getattr(engine, "streams_prefill_rows", False))


def kv_buffer_maker(engine: object) -> KVBufferMaker | None:
    """The engine's ``kv_buffers``, or None: received K/V then lands in pooled numpy buffers."""
    return getattr(engine, "kv_buffers", None)


def reserve_prefix(engine: object, request_id: str, tokens: Sequence[int], prefix: int) -> bool:
    """``engine.reserve_prefix``; False for an engine without one (it holds no prefixes)."""
    reserve: PrefixReserver | None = getattr(engine, "reserve_prefix", None)
    return reserve is not None and bool(reserve(request_id, tokens, prefix))


def release_prefix(engine: object, request_id: str) -> None:
    """``engine.release_prefix`` where the engine has one (idempotent)."""
    release = getattr(engine, "release_prefix", None)
    if release is not None:
        release(request_id)


class Engine(Protocol):
    """What every engine plugin provides (``mlxcel_register_engines``).

    Optional, found by ``layer_adopter``: ``adopt_layer(layer: CacheLayer) ->
    CacheLayer`` copies one received layer into the engine's own arrays. The
    decode node calls it on its event loop as each layer of a handoff completes,
    while later layers are still arriving, so the engine thread never pays the
    copy and the receive buffers are reused after one layer. It must touch no
    engine state; raising fails that handoff only. Without it, ``decode`` gets
    numpy layers.

    Optional, found by ``kv_buffer_maker``: ``kv_buffers(shape, dtype, count) ->
    list[np.ndarray]``, numpy views of ``count`` fresh arrays in the engine's
    own memory (a layer's K and V at once). The decode node then receives K/V
    straight into them (the link decrypts into the views) and ``adopt_layer``
    hands back the engine arrays without a copy. Same threading rules as
    ``adopt_layer``.

    Optional, for delta handoffs (``reserve_prefix`` / ``release_prefix`` below):
    ``reserve_prefix(request_id, tokens, prefix_tokens) -> bool`` pins the K/V
    the engine holds for exactly ``tokens[:prefix_tokens]`` (its prefix cache)
    for that request, so no eviction can lose them, and says whether it could:
    an engine without a prefix cache, or without that prefix, returns False.
    Thread-safe and quick (the decode node calls it on its event loop). A
    ``decode`` of that request then takes a cache whose layers hold positions
    ``[prefix_tokens, offset)`` only and splices the pinned prefix in front;
    the pin ends there, or with ``release_prefix(request_id)`` (idempotent,
    any thread) or ``cancel``.
    """

    info: ModelInfo

    def start(self) -> None:
        """Start the engine thread (and warm up when configured)."""

    def close(self) -> None:
        """Stop the thread; pending requests end with FINISH_CANCELLED."""

    def generate(self, request: GenerationRequest, emit: EmitToken) -> None:
        """Single node: prefill then decode locally; emit every token, then one terminal event."""

    def prefill(
        self, request: GenerationRequest, on_done: PrefillDone, on_layer: LayerReady | None = None
    ) -> None:
        """Prefill only: ``on_layer`` as each layer's K/V is evaluated, then ``on_done``.

        An engine with ``streams_prefill_rows`` (``prefill_rows``) also takes ``on_rows``
        (``RowsReady``): each cell's rows of each plain KVCache layer after its forward.
        """

    def decode(
        self, request: GenerationRequest, first_token: int, cache: CacheState, emit: EmitToken
    ) -> None:
        """Join the running batch with a cache prefilled elsewhere; emits tokens from index 1.

        ``cache`` layers hold numpy arrays, or what this engine's ``adopt_layer`` returned.
        """

    def cancel(self, request_id: str) -> None:
        """Stop a request and free its memory; emits a FINISH_CANCELLED event if it was live."""

    def stats(self) -> EngineStats: ...
