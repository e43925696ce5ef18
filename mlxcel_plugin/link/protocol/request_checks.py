"""What a REQUEST frame may carry: ranges, finite numbers, canonical addresses (pure).

Why here and not only at the HTTP front: a node serves whatever arrives on
an authenticated link, and a router-role peer is not trusted to have
validated (a NaN temperature reached the engine and sampled token 49152,
outside the vocabulary). The same table bounds what a router may encode, so
a value the front let through fails with a named error before it is sent.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Mapping
from typing import Any

from mlxcel_plugin.link.protocol.frame_codec import MalformedFrame
from mlxcel_plugin.logprobs import MAX_TOP_LOGPROBS
from mlxcel_plugin.structured_output import MAX_GRAMMAR_CHARS

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
TOKEN_ID_MAX = (1 << 32) - 1  # prompt ids travel as uint32; stop ids may not exceed them
MAX_REQUEST_ID_CHARS = 256
MAX_HOST_CHARS = 253
_HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")

# Sampling fields a node acts on, with the values it accepts (inclusive; the front's
# OpenAI ranges). Unknown keys (a newer router's) are ignored by the node.
FLOAT_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.0, 10.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
}
INT_RANGES: dict[str, tuple[int, int]] = {
    "top_k": (0, INT64_MAX), "seed": (INT64_MIN, INT64_MAX),
    "logprobs": (0, MAX_TOP_LOGPROBS), "prompt_logprobs": (0, MAX_TOP_LOGPROBS),
    "grammar_replay_tokens": (0, TOKEN_ID_MAX),
}
STR_LIMITS: dict[str, int] = {"grammar": MAX_GRAMMAR_CHARS}  # characters


class FieldOutOfRange(MalformedFrame):
    """A header number outside what the link carries or the node accepts."""

    code = "frame_field_out_of_range"


class DecodeTargetMalformed(MalformedFrame):
    code = "decode_target_malformed"


def check_int(name: str, value: Any, low: int = INT64_MIN, high: int = INT64_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MalformedFrame(f"frame header field {name!r} must be an integer")
    if not low <= value <= high:
        raise FieldOutOfRange(f"frame header field {name!r} = {_short(value)} is outside "
                              f"[{low}, {high}]")
    return value


def check_float(name: str, value: Any, low: float = -math.inf, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedFrame(f"frame header field {name!r} must be a number")
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        raise FieldOutOfRange(f"frame header field {name!r} = {_short(value)} is out of range")
    number = float(value)
    if not math.isfinite(number) or not low <= number <= high:
        raise FieldOutOfRange(f"frame header field {name!r} = {_short(value)} is not a finite "
                              f"number in [{low}, {high}]")
    return number


def check_sampling(sampling: Mapping[Any, Any]) -> None:
    """Known sampling fields in range and finite; keys must be strings."""
    for key, value in sampling.items():
        if not isinstance(key, str):
            raise MalformedFrame("sampling keys must be strings")
        if value is None:
            continue
        if key in FLOAT_RANGES:
            check_float(f"sampling.{key}", value, *FLOAT_RANGES[key])
        elif key in INT_RANGES:
            check_int(f"sampling.{key}", value, *INT_RANGES[key])
        elif key in STR_LIMITS and not (isinstance(value, str) and len(value) <= STR_LIMITS[key]):
            raise FieldOutOfRange(f"frame header field 'sampling.{key}' must be a string of at "
                                  f"most {STR_LIMITS[key]} characters")


def check_request_id(request_id: str) -> None:
    if not request_id or len(request_id) > MAX_REQUEST_ID_CHARS:
        raise MalformedFrame(f"request_id must be 1-{MAX_REQUEST_ID_CHARS} characters")


def check_token_ids(name: str, token_ids: list[int]) -> None:
    for value in token_ids:  # bounded by the list (the caller caps its length)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= TOKEN_ID_MAX:
            raise FieldOutOfRange(f"frame header field {name!r} holds {_short(value)}, not a "
                                  f"token id in [0, {TOKEN_ID_MAX}]")


def canonical_host_port(text: str) -> str:
    """'host:port' as one spelling (lower-case name, compressed IPv6 in brackets); or raises.

    No whitespace, no scheme or path, port 1-65535: a target that would only fail
    when dialed is refused when it arrives.
    """
    if not isinstance(text, str) or text != text.strip() or not text:
        raise DecodeTargetMalformed(f"decode_target {_short(text)} is not host:port")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise DecodeTargetMalformed(f"decode_target {_short(text)} has no valid port")
    return f"{_canonical_host(host, text)}:{int(port)}"


def _canonical_host(host: str, text: str) -> str:
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        address = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        if bracketed or len(host) > MAX_HOST_CHARS or not _HOST_NAME.fullmatch(host):
            raise DecodeTargetMalformed(f"decode_target {_short(text)} has no valid host") from None
        return host.lower()
    if address.version == 6:
        if not bracketed:
            raise DecodeTargetMalformed(f"decode_target {_short(text)}: IPv6 needs [brackets]")
        return f"[{address.compressed}]"
    return address.compressed


def _short(value: Any) -> str:
    return f"{value!r:.60}"
