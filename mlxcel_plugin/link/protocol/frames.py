"""Link frames: the typed frames of the protocol, on the codec in ``frame_codec``.

Each frame is a frozen dataclass with ``to_frame`` / ``from_frame``. Every
optional header field has a default and unknown fields are ignored, so minor
versions interoperate. The codec's names are re-exported here, so callers
import every frame name from this module. See docs/protocol.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from mlxcel_plugin.link.protocol import request_checks as checks
from mlxcel_plugin.link.protocol.adapter_frames import AdapterCommand, adapter_map, optional_name
from mlxcel_plugin.link.protocol.body_parts import BodyParts
from mlxcel_plugin.link.protocol.frame_codec import (
    MAX_HEADER_BYTES,
    MAX_PROMPT_TOKENS,
    Body,
    Frame,
    FrameError,
    FrameType,
    MalformedFrame,
    PromptTooLong,
    UnknownFrameType,
    decode_frame,
    encode_frame,
    encode_header,
    expect_type,
    frame_size,
    get_field,
    get_int_list,
    pack_token_ids,
    split_frame,
    unpack_token_ids,
)
from mlxcel_plugin.link.protocol.spec_counts import spec_counts
from mlxcel_plugin.logprobs import (
    LogprobsMalformed,
    PromptLogprobs,
    TokenLogprobs,
    tokens_from_wire,
    tokens_to_wire,
)

__all__ = [
    "AdapterCommand",
    "Body",
    "BodyParts",
    "Cancel",
    "ErrorFrame",
    "Frame",
    "FrameError",
    "FrameType",
    "MAX_HEADER_BYTES",
    "MAX_PROMPT_TOKENS",
    "MalformedFrame",
    "Ping",
    "PromptTooLong",
    "Request",
    "Result",
    "Telemetry",
    "UnknownFrameType",
    "decode_frame",
    "encode_frame",
    "encode_header",
    "expect_type",
    "frame_size",
    "get_field",
    "get_int_list",
    "kv_frame",
    "pack_token_ids",
    "parse_typed",
    "split_frame",
    "unpack_token_ids",
]


# ---------------------------------------------------------------- typed frames


@dataclass(frozen=True)
class Request:
    """Router → prefill: one generation request, in token ids.

    Router → decode: the same frame with ``claim=True`` and an empty prompt
    registers the lease — that router link owns the request and gets its tokens.

    ``decode_cached_tokens``: the router believes the decode node holds the K/V
    of the first that many prompt tokens, so the prefill node ships only the
    rest (a delta handoff; 0 = the whole cache). Below the prompt's length.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any] = field(default_factory=dict)
    max_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    decode_target: str | None = None  # host:port chosen by the router
    deadline_unix_s: float | None = None  # wall clock, None = no deadline
    claim: bool = False  # a decode lease, not work to run; the prompt may be empty
    decode_cached_tokens: int = 0  # prompt tokens the decode node holds already
    # The LoRA adapter the prompt runs with, and the digest of its files (None: the base).
    adapter: str | None = None
    adapter_digest: str | None = None

    TYPE: ClassVar[FrameType] = FrameType.REQUEST

    def to_frame(self) -> Frame:
        if len(self.prompt_token_ids) > MAX_PROMPT_TOKENS:
            raise PromptTooLong(f"prompt of {len(self.prompt_token_ids)} tokens exceeds "
                                f"the cap of {MAX_PROMPT_TOKENS}")
        self._check()  # what a node would refuse fails here, by name, before it is sent
        header = {"request_id": self.request_id, "sampling": self.sampling,
                  "max_tokens": self.max_tokens, "stop_token_ids": list(self.stop_token_ids),
                  "decode_target": self.decode_target, "deadline_unix_s": self.deadline_unix_s}
        if self.claim:
            # Only when set: a plain request keeps its golden bytes.
            header["claim"] = True
        if self.decode_cached_tokens:  # the same: absent means 0
            header["decode_cached_tokens"] = self.decode_cached_tokens
        if self.adapter is not None:  # the same: absent means the base
            header.update(adapter=self.adapter, adapter_digest=self.adapter_digest)
        return Frame(self.TYPE, header, pack_token_ids(self.prompt_token_ids))

    @classmethod
    def from_frame(cls, frame: Frame) -> Request:
        expect_type(frame, cls.TYPE)
        h = frame.header
        request = cls(
            request_id=get_field(h, "request_id", str, required=True),
            prompt_token_ids=unpack_token_ids(frame.body),
            sampling=get_field(h, "sampling", dict, {}),
            max_tokens=get_field(h, "max_tokens", int, 256),
            stop_token_ids=get_int_list(h, "stop_token_ids"),
            decode_target=get_field(h, "decode_target", str),
            deadline_unix_s=_float_or_none(h, "deadline_unix_s"),
            claim=get_field(h, "claim", bool, False),
            decode_cached_tokens=get_field(h, "decode_cached_tokens", int, 0),
            adapter=optional_name(h, "adapter"),
            adapter_digest=optional_name(h, "adapter_digest"),
        )
        target = request._check()
        return request if target == request.decode_target else replace(request,
                                                                        decode_target=target)

    def _check(self) -> str | None:
        """Every field in range (request_checks); returns the canonical decode_target."""
        checks.check_request_id(self.request_id)
        checks.check_int("max_tokens", self.max_tokens, 0)
        checks.check_token_ids("stop_token_ids", self.stop_token_ids)
        checks.check_sampling(self.sampling)
        if self.deadline_unix_s is not None:
            checks.check_float("deadline_unix_s", self.deadline_unix_s)
        _check_cached_tokens(self.decode_cached_tokens, len(self.prompt_token_ids))
        if self.decode_target is None:
            return None
        return checks.canonical_host_port(self.decode_target)


def _check_cached_tokens(cached: int, prompt_tokens: int) -> None:
    if isinstance(cached, bool) or not 0 <= cached < max(prompt_tokens, 1):
        raise MalformedFrame(f"decode_cached_tokens {cached!r:.40} is not in [0, {prompt_tokens})")


def _float_or_none(header: Mapping[str, Any], name: str) -> float | None:
    value = get_field(header, name, (int, float))
    return None if value is None else float(value)


@dataclass(frozen=True)
class Result:
    """Prefill/decode → router: tokens for one request, in order by ``seq``."""

    request_id: str
    seq: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "cancelled", "error"; None = more
    generated_tokens: int = 0
    error: str | None = None
    # With the first token: prompt tokens served from the prefill node's prefix cache.
    cached_tokens: int = 0
    # One per token id when the request asked logprobs; () = none (an older peer's).
    logprobs: tuple[TokenLogprobs, ...] = ()
    # With the first token when asked; travels as the body (``prompt_logprobs_top`` = k).
    prompt_logprobs: PromptLogprobs | None = None

    TYPE: ClassVar[FrameType] = FrameType.RESULT

    def to_frame(self) -> Frame:
        header = {
            "request_id": self.request_id, "seq": self.seq, "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason, "generated_tokens": self.generated_tokens,
            "error": self.error,
        }
        if self.cached_tokens:  # absent means 0: older peers send and read the same bytes
            header["cached_tokens"] = self.cached_tokens
        if self.logprobs:  # the same: absent means none
            header["logprobs"] = tokens_to_wire(self.logprobs)
        if self.prompt_logprobs is None:
            return Frame(self.TYPE, header)
        header["prompt_logprobs_top"] = self.prompt_logprobs.top
        return Frame(self.TYPE, header, self.prompt_logprobs.to_body())

    @classmethod
    def from_frame(cls, frame: Frame) -> Result:
        expect_type(frame, cls.TYPE)
        h = frame.header
        token_ids = get_int_list(h, "token_ids")
        top = get_field(h, "prompt_logprobs_top", int)
        try:
            logprobs = tokens_from_wire(h.get("logprobs"), len(token_ids))
            prompt = None if top is None else PromptLogprobs.from_body(frame.body, top)
        except LogprobsMalformed as exc:
            raise MalformedFrame(f"RESULT {exc.message}") from None
        return cls(
            request_id=get_field(h, "request_id", str, required=True),
            seq=get_field(h, "seq", int, required=True),
            token_ids=token_ids,
            finish_reason=get_field(h, "finish_reason", str),
            generated_tokens=get_field(h, "generated_tokens", int, 0),
            error=get_field(h, "error", str),
            cached_tokens=get_field(h, "cached_tokens", int, 0),
            logprobs=logprobs,
            prompt_logprobs=prompt,
        )


@dataclass(frozen=True)
class Cancel:
    request_id: str
    reason: str = ""

    TYPE: ClassVar[FrameType] = FrameType.CANCEL

    def to_frame(self) -> Frame:
        return Frame(self.TYPE, {"request_id": self.request_id, "reason": self.reason})

    @classmethod
    def from_frame(cls, frame: Frame) -> Cancel:
        expect_type(frame, cls.TYPE)
        h = frame.header
        return cls(get_field(h, "request_id", str, required=True), get_field(h, "reason", str, ""))


@dataclass(frozen=True)
class Telemetry:
    """Live load of a node, sent periodically over its links (feeds the balancers)."""

    node_id: str
    role: str
    queue_depth: int = 0
    active_sequences: int = 0
    free_kv_fraction: float = 1.0
    tokens_per_s: float = 0.0
    # The node's prefix cache: running totals of tokens hit and looked up, bytes held now.
    prefix_hit_tokens: int = 0
    prefix_lookup_tokens: int = 0
    prefix_cached_bytes: int = 0
    prefix_evictions: int = 0
    prefix_capacity_bytes: int = 0  # 0: the node keeps no prefix cache
    adapters: Mapping[str, str] = field(default_factory=dict)  # LoRA name -> digest, held now
    # Speculative decoding totals: method -> (proposed, accepted) (link/protocol/spec_counts).
    speculative: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    TYPE: ClassVar[FrameType] = FrameType.TELEMETRY
    _PREFIX_FIELDS: ClassVar[tuple[str, ...]] = (
        "prefix_hit_tokens", "prefix_lookup_tokens", "prefix_cached_bytes", "prefix_evictions",
        "prefix_capacity_bytes",
    )

    def to_frame(self) -> Frame:
        header = {
            "node_id": self.node_id, "role": self.role, "queue_depth": self.queue_depth,
            "active_sequences": self.active_sequences,
            "free_kv_fraction": float(self.free_kv_fraction),
            "tokens_per_s": float(self.tokens_per_s),
        }
        # Absent means 0, so a node without a prefix cache sends the bytes it always did.
        header.update({k: getattr(self, k) for k in self._PREFIX_FIELDS if getattr(self, k)})
        if self.adapters:  # the same: absent means none
            header["adapters"] = dict(self.adapters)
        if self.speculative:
            header["speculative"] = {m: list(pair) for m, pair in self.speculative.items()}
        return Frame(self.TYPE, header)

    @classmethod
    def from_frame(cls, frame: Frame) -> Telemetry:
        expect_type(frame, cls.TYPE)
        h = frame.header
        return cls(
            node_id=get_field(h, "node_id", str, required=True),
            role=get_field(h, "role", str, required=True),
            queue_depth=get_field(h, "queue_depth", int, 0),
            active_sequences=get_field(h, "active_sequences", int, 0),
            free_kv_fraction=float(get_field(h, "free_kv_fraction", (int, float), 1.0)),
            tokens_per_s=float(get_field(h, "tokens_per_s", (int, float), 0.0)),
            **{k: get_field(h, k, int, 0) for k in cls._PREFIX_FIELDS},
            adapters=adapter_map(h),
            speculative=spec_counts(h),
        )


@dataclass(frozen=True)
class Ping:
    """Application-level ping; a Link answers it with a PONG carrying the same nonce."""

    nonce: int = 0
    sent_at_s: float = 0.0  # sender's monotonic clock, echoed back

    TYPE: ClassVar[FrameType] = FrameType.PING

    def to_frame(self) -> Frame:
        return Frame(self.TYPE, {"nonce": self.nonce, "sent_at_s": float(self.sent_at_s)})

    @classmethod
    def from_frame(cls, frame: Frame) -> Ping:
        if frame.type not in (FrameType.PING, FrameType.PONG):
            raise MalformedFrame(f"expected a PING or PONG frame, got {frame.type.name}")
        h = frame.header
        sent_at_s = float(get_field(h, "sent_at_s", (int, float), 0.0))
        return cls(get_field(h, "nonce", int, 0), sent_at_s)

    def pong(self) -> Frame:
        return Frame(FrameType.PONG, {"nonce": self.nonce, "sent_at_s": float(self.sent_at_s)})


@dataclass(frozen=True)
class ErrorFrame:
    """A failure the peer should know about; ``code`` is an errors.py code name."""

    code: str
    message: str = ""
    request_id: str | None = None

    TYPE: ClassVar[FrameType] = FrameType.ERROR

    def to_frame(self) -> Frame:
        return Frame(self.TYPE, {"code": self.code, "message": self.message,
                                 "request_id": self.request_id})

    @classmethod
    def from_frame(cls, frame: Frame) -> ErrorFrame:
        expect_type(frame, cls.TYPE)
        h = frame.header
        return cls(get_field(h, "code", str, required=True), get_field(h, "message", str, ""),
                   get_field(h, "request_id", str))


def kv_frame(frame_type: FrameType, header: Mapping[str, Any], body: Body = b"") -> Frame:
    """KV_BEGIN/CHUNK/END/ACK: the KV layer owns the header fields; frames just carry them."""
    if frame_type not in (FrameType.KV_BEGIN, FrameType.KV_CHUNK, FrameType.KV_END,
                          FrameType.KV_ACK):
        raise ValueError(f"{frame_type.name} is not a KV frame type")
    return Frame(frame_type, dict(header), body)


TYPED_FRAMES: dict[FrameType, type] = {
    FrameType.REQUEST: Request, FrameType.RESULT: Result, FrameType.CANCEL: Cancel,
    FrameType.TELEMETRY: Telemetry, FrameType.PING: Ping, FrameType.PONG: Ping,
    FrameType.ERROR: ErrorFrame, FrameType.ADAPTER: AdapterCommand,
}


def parse_typed(frame: Frame) -> Any:
    """The typed dataclass for a frame, or the frame itself for KV frames."""
    cls = TYPED_FRAMES.get(frame.type)
    return frame if cls is None else cls.from_frame(frame)
