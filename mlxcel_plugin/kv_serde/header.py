"""The KV_BEGIN header: who the handoff is for, which model made it, how to continue.

Everything the decode node needs besides the tensors travels here, so the
``GenerationRequest`` can be rebuilt exactly (``HandoffHeader.to_request``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from mlxcel_plugin.engine_api import GenerationRequest, SamplingParams
from mlxcel_plugin.kv_codecs import TENSOR_DTYPES, storage_dtype
from mlxcel_plugin.kv_serde import fields as f
from mlxcel_plugin.kv_serde.errors import (
    CacheClassNotTransferable,
    FingerprintMismatch,
    LayerCountMismatch,
    MalformedHandoff,
    OversizeDeclared,
    UnsupportedHandoffVersion,
)
from mlxcel_plugin.kv_serde.fields import MAX_LAYERS, MAX_TOKENS
from mlxcel_plugin.kv_serde.layer_spec import LayerSpec, kv_layer, parse_layers
from mlxcel_plugin.kv_serde.messages import KVMessage
from mlxcel_plugin.kv_serde.versions import (
    AEAD_ONLY_SERDE_VERSION,
    BODY_CHECKSUM_SERDE_VERSION,
    CHECKSUM_OF_ENCODED,
    CHECKSUM_OF_HELD,
    CHECKSUM_OF_NONE,
    CHECKSUM_VERSIONS,
    DELTA_SERDE_VERSION,
    IDENTITY_CODEC,
    SERDE_VERSION,
    SUPPORTED_SERDE_VERSIONS,
)
from mlxcel_plugin.logprobs import MAX_TOP_LOGPROBS
from mlxcel_plugin.structured_output import MAX_GRAMMAR_CHARS

__all__ = ["AEAD_ONLY_SERDE_VERSION", "BODY_CHECKSUM_SERDE_VERSION", "CHECKSUM_OF_ENCODED",
           "CHECKSUM_OF_HELD", "CHECKSUM_OF_NONE", "DELTA_SERDE_VERSION", "IDENTITY_CODEC",
           "SERDE_VERSION", "SUPPORTED_SERDE_VERSIONS", "HandoffHeader", "ModelFingerprint",
           "SerializableSamplingState"]
SUPPORTED_CACHE_KINDS = frozenset(
    {"KVCache", "RotatingKVCache", "ArraysCache", "QuantizedKVCache", "ChunkedKVCache"}
)
MAX_HEADS = 4096
MAX_HEAD_DIM = 65536
MAX_TOKEN_ID = 2**31 - 1
MAX_STOP_IDS = 1024
_TOKEN = np.dtype("<u4")


@dataclass(frozen=True)
class ModelFingerprint:
    """What must match between sender and receiver before any byte is allocated.

    ``layers`` describes every handoff layer (``layer_spec``); a fingerprint
    without it (an older peer) means plain ``[1, kv_heads, T, head_dim]`` K/V
    in every layer, and ``kv_heads``/``head_dim`` are set only for such
    uniform models (0 otherwise). ``model_digest`` (optional, e.g. a hash of
    the weights) is compared only when both sides set it: same architecture
    with other weights decodes garbage.
    """

    architecture: str
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    cache_classes: tuple[str, ...]
    model_digest: str = ""
    layers: tuple[LayerSpec, ...] = ()

    def __post_init__(self) -> None:
        if not self.layers:
            uniform = tuple(kv_layer(kind, self.kv_heads, self.head_dim, self.dtype)
                            for kind in self.cache_classes)
            object.__setattr__(self, "layers", uniform)

    @property
    def row_bytes(self) -> int:
        """Bytes of one head's K (or V) for one token (uniform models)."""
        return self.head_dim * storage_dtype(self.dtype).itemsize

    def tensor_bytes(self, tokens: int) -> int:
        return self.kv_heads * tokens * self.row_bytes

    def kv_bytes(self, tokens: int) -> int:
        """Every array of every layer for ``tokens`` positions (fixed-size state once)."""
        return sum(layer.nbytes(tokens) for layer in self.layers)

    def to_dict(self) -> dict[str, Any]:
        data = {
            "architecture": self.architecture,
            "num_layers": self.num_layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "cache_classes": list(self.cache_classes),
            "layers": [layer.to_dict() for layer in self.layers],
        }
        if self.model_digest:
            data["model_digest"] = self.model_digest
        return data

    @classmethod
    def from_dict(cls, data: Any) -> ModelFingerprint:
        """Parse (and validate) a peer's fingerprint or ``ModelInfo.fingerprint``."""
        data = f.as_map(data, "fingerprint")
        dtype = f.get_str(data, "dtype", 32)
        if dtype not in TENSOR_DTYPES:
            raise MalformedHandoff(f"fingerprint dtype {dtype!r} is not one of {TENSOR_DTYPES}")
        num_layers = f.get_int(data, "num_layers", 1, MAX_LAYERS)
        classes = f.get_str_list(data, "cache_classes", MAX_LAYERS)
        if len(classes) != num_layers:
            raise MalformedHandoff(
                f"fingerprint lists {len(classes)} cache classes for {num_layers} layers"
            )
        described = data.get("layers") is not None
        layers = parse_layers(data["layers"], MAX_LAYERS) if described else ()
        if described and tuple(layer.kind for layer in layers) != classes:
            raise MalformedHandoff("fingerprint layers do not match its cache classes")
        lo = 0 if described else 1  # an undescribed (older) fingerprint needs the uniform shape
        return cls(
            architecture=f.get_str(data, "architecture", 128),
            num_layers=num_layers,
            kv_heads=f.get_int(data, "kv_heads", lo, MAX_HEADS),
            head_dim=f.get_int(data, "head_dim", lo, MAX_HEAD_DIM),
            dtype=dtype,
            cache_classes=classes,
            model_digest=f.get_optional_str(data, "model_digest") or "",
            layers=layers,
        )

    def check_supported(self) -> None:
        undescribed = {layer.kind for layer in self.layers if not layer.arrays}
        unsupported = sorted(set(self.cache_classes) - SUPPORTED_CACHE_KINDS | undescribed)
        if unsupported:
            raise CacheClassNotTransferable(
                f"cache classes {unsupported} cannot be handed off; "
                f"supported: {sorted(SUPPORTED_CACHE_KINDS)}"
            )

    def check_matches(self, local: ModelFingerprint) -> None:
        """Refuse a peer fingerprint (self) that does not match ours (local)."""
        if self.num_layers != local.num_layers:
            raise LayerCountMismatch(
                f"sender model has {self.num_layers} layers, this node's has {local.num_layers}"
            )
        for name in ("architecture", "kv_heads", "head_dim", "dtype", "cache_classes", "layers"):
            theirs, ours = getattr(self, name), getattr(local, name)
            if theirs != ours:
                raise FingerprintMismatch(
                    f"model {name} differs: sender {theirs!r:.120}, here {ours!r:.120}"
                )
        if self.model_digest and local.model_digest and self.model_digest != local.model_digest:
            raise FingerprintMismatch("model weights digest differs")


def _sampling_params_from_dict(data: Any) -> SamplingParams:
    """SamplingParams with every known field type-checked (unknown keys ignored)."""
    data = f.as_map(data, "sampling params")
    values: dict[str, Any] = {}
    for spec in fields(SamplingParams):
        if data.get(spec.name) is None:
            continue
        if spec.name == "seed":
            values["seed"] = f.get_int(data, "seed", -(2**63), 2**64 - 1)
        elif spec.name == "top_k":
            values["top_k"] = f.get_int(data, "top_k", 0, 1 << 31)
        elif spec.name in ("logprobs", "prompt_logprobs"):
            values[spec.name] = f.get_int(data, spec.name, 0, MAX_TOP_LOGPROBS)
        elif spec.name == "grammar":  # mlxcel_plugin/structured_output.py
            values["grammar"] = f.get_str(data, "grammar", MAX_GRAMMAR_CHARS)
        elif spec.name == "speculative":  # mlxcel_plugin/speculative/settings.py
            values["speculative"] = f.get_str(data, "speculative", 16)
        elif spec.name == "grammar_replay_tokens":
            values[spec.name] = f.get_int(data, spec.name, 0, MAX_TOKENS)
        else:
            values[spec.name] = f.get_float(data, spec.name, -1e9, 1e9)
    return SamplingParams(**values)


@dataclass(frozen=True)
class SerializableSamplingState:
    """How decoding continues: params, penalty context, step index, stop ids, budget.

    ``prompt_tokens`` is the penalty context (repetition/presence/frequency);
    ``step`` is the completion index of the next token to sample, so seeded
    sampling — a pure function of (seed, position) — continues where prefill stopped.
    """

    params: SamplingParams = field(default_factory=SamplingParams)
    prompt_tokens: tuple[int, ...] = ()
    step: int = 1
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int = 1

    @property
    def seed(self) -> int | None:
        return self.params.seed

    @classmethod
    def from_request(cls, request: GenerationRequest, step: int = 1) -> SerializableSamplingState:
        return cls(
            params=request.sampling,
            prompt_tokens=tuple(request.prompt_tokens),
            step=step,
            stop_token_ids=tuple(request.stop_token_ids),
            max_tokens=request.max_tokens,
        )

    def to_dict(self) -> dict[str, Any]:
        """Everything but ``prompt_tokens``: they travel packed in the begin body."""
        return {
            "params": self.params.to_dict(),
            "step": self.step,
            "stop_token_ids": list(self.stop_token_ids),
            "max_tokens": self.max_tokens,
        }

    @classmethod
    def from_dict(cls, data: Any, prompt_tokens: tuple[int, ...] = ()) -> SerializableSamplingState:
        data = f.as_map(data, "sampling")
        return cls(
            params=_sampling_params_from_dict(data.get("params", {})),
            prompt_tokens=prompt_tokens,
            step=f.get_int(data, "step", 0, MAX_TOKENS),
            stop_token_ids=f.get_int_list(data, "stop_token_ids", MAX_STOP_IDS, 0, MAX_TOKEN_ID),
            max_tokens=f.get_int(data, "max_tokens", 1, MAX_TOKENS),
        )


def pack_tokens(tokens: tuple[int, ...]) -> bytes:
    """Little-endian uint32, as ``frames.pack_token_ids`` packs REQUEST prompts."""
    return np.asarray(tokens, dtype=_TOKEN).tobytes()


def unpack_tokens(body: Any, count: int) -> tuple[int, ...]:
    if len(body) != count * _TOKEN.itemsize:
        raise MalformedHandoff(f"begin body is {len(body)} bytes for {count} context tokens")
    tokens = np.frombuffer(body, dtype=_TOKEN)
    if count and int(tokens.max()) > MAX_TOKEN_ID:
        raise MalformedHandoff("a context token id is out of range")
    return tuple(tokens.tolist())


def _prefix_tokens(data: Any, version: int, prompt_length: int, context: int) -> int:
    """A delta's prefix: under the prompt, with the prompt named (what the receiver checks)."""
    if data.get("prefix_tokens") is None:
        return 0
    prefix = f.get_int(data, "prefix_tokens", 0, prompt_length - 1)
    if prefix and (version < DELTA_SERDE_VERSION or context != prompt_length):
        raise MalformedHandoff(
            f"a delta of {prefix} prefix tokens needs serde version {DELTA_SERDE_VERSION} "
            "and the prompt tokens in the begin body"
        )
    return prefix


def _checksum_of(data: Any, version: int) -> str:
    kind = data.get("checksum_of", CHECKSUM_OF_HELD)
    if kind not in CHECKSUM_VERSIONS:
        raise MalformedHandoff(f"checksum_of must be 'held', 'encoded' or 'none', "
                               f"got {kind!r:.40}")
    if version < CHECKSUM_VERSIONS[kind]:
        raise MalformedHandoff(f"checksum_of {kind!r} needs serde version "
                               f"{CHECKSUM_VERSIONS[kind]}")
    if kind == CHECKSUM_OF_NONE and data.get("codec") != IDENTITY_CODEC:
        raise MalformedHandoff("checksum_of 'none' is for codec 'none' only: a codec that "
                               "transforms the bytes keeps its digest")
    return kind


@dataclass(frozen=True)
class HandoffHeader:
    """The KV_BEGIN header.

    ``handoff_id`` names one handoff of ``request_id``; ``epoch`` counts its
    attempts, so a retried handoff's late messages are refused as stale.
    ``deadline_in_s`` is the time left when sent — relative, because node
    clocks are not synchronized. The penalty context (prompt tokens) travels as
    the begin message's body, not in the msgpack header, whose size frames bound.

    ``prefix_tokens`` > 0 makes it a *delta*: the receiver already holds the K/V
    of the first ``prefix_tokens`` prompt tokens, and every layer carries only
    positions ``[prefix_tokens, prompt_length)``. A delta names its prompt
    tokens (the receiver checks it holds exactly that prefix) and goes out as
    ``DELTA_SERDE_VERSION``; a full handoff's bytes are what they always were.
    """

    request_id: str
    handoff_id: str
    epoch: int
    fingerprint: ModelFingerprint
    prompt_length: int
    first_token: int
    codec: str = "none"
    sampling: SerializableSamplingState = field(default_factory=SerializableSamplingState)
    deadline_in_s: float | None = None
    version: int = SERDE_VERSION
    prefix_tokens: int = 0  # held by the receiver already; 0: a full handoff
    checksum_of: str = CHECKSUM_OF_HELD  # what the end's crc32s cover (see above)

    @property
    def checksummed(self) -> bool:
        """Whether the end's crc32s are checked (not for ``checksum_of = "none"``)."""
        return self.checksum_of != CHECKSUM_OF_NONE

    @property
    def shipped_tokens(self) -> int:
        """Positions each layer carries: the prompt less the receiver's prefix."""
        return self.prompt_length - self.prefix_tokens

    @property
    def wire_version(self) -> int:
        version = max(self.version, CHECKSUM_VERSIONS[self.checksum_of])
        return max(version, DELTA_SERDE_VERSION) if self.prefix_tokens else version

    def to_dict(self) -> dict[str, Any]:
        data = {
            "version": self.wire_version,
            "request_id": self.request_id,
            "handoff_id": self.handoff_id,
            "epoch": self.epoch,
            "fingerprint": self.fingerprint.to_dict(),
            "prompt_length": self.prompt_length,
            "first_token": self.first_token,
            "codec": self.codec,
            "sampling": self.sampling.to_dict(),
            "context_tokens": len(self.sampling.prompt_tokens),
            "deadline_in_s": self.deadline_in_s,
        }
        if self.prefix_tokens:  # absent means 0: a full handoff keeps its bytes
            data["prefix_tokens"] = self.prefix_tokens
        if self.checksum_of != CHECKSUM_OF_HELD:  # absent means held: the first format
            data["checksum_of"] = self.checksum_of
        return data

    def to_message(self) -> KVMessage:
        return KVMessage("begin", self.to_dict(), pack_tokens(self.sampling.prompt_tokens))

    @classmethod
    def from_message(cls, message: KVMessage, max_prompt_tokens: int = MAX_TOKENS) -> HandoffHeader:
        return cls.from_dict(message.header, message.body, max_prompt_tokens)

    @classmethod
    def from_dict(
        cls, data: Any, context_body: Any = b"", max_prompt_tokens: int = MAX_TOKENS
    ) -> HandoffHeader:
        data = f.as_map(data, "begin header")
        version = f.get_int(data, "version", 0)
        if version not in SUPPORTED_SERDE_VERSIONS:
            raise UnsupportedHandoffVersion(
                f"handoff serde version {version}; this node speaks {SUPPORTED_SERDE_VERSIONS}"
            )
        prompt_length = f.get_int(data, "prompt_length", 1, MAX_TOKENS)
        if prompt_length > max_prompt_tokens:
            raise OversizeDeclared(f"prompt_length {prompt_length} > {max_prompt_tokens}")
        context = f.get_int(data, "context_tokens", 0, prompt_length)
        if context not in (0, prompt_length):
            raise MalformedHandoff(f"{context} context tokens for prompt_length {prompt_length}")
        prefix = _prefix_tokens(data, version, prompt_length, context)
        tokens = unpack_tokens(context_body, context)
        sampling = SerializableSamplingState.from_dict(data.get("sampling", {}), tokens)
        return cls(
            request_id=f.get_str(data, "request_id"),
            handoff_id=f.get_str(data, "handoff_id"),
            epoch=f.get_int(data, "epoch", 0),
            fingerprint=ModelFingerprint.from_dict(data.get("fingerprint")),
            prompt_length=prompt_length,
            first_token=f.get_int(data, "first_token", 0, MAX_TOKEN_ID),
            codec=f.get_str(data, "codec", 128),
            sampling=sampling,
            deadline_in_s=f.get_optional_float(data, "deadline_in_s", 0.0, 1e9),
            version=version,
            prefix_tokens=prefix,
            checksum_of=_checksum_of(data, version),
        )

    def to_request(self) -> GenerationRequest:
        """The request as the decode engine takes it."""
        return GenerationRequest(
            request_id=self.request_id,
            prompt_tokens=self.sampling.prompt_tokens,
            max_tokens=self.sampling.max_tokens,
            sampling=self.sampling.params,
            stop_token_ids=self.sampling.stop_token_ids,
        )
