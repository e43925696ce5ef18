"""The request body at the edge: media type, size, JSON, depth, strings, numbers.

What a body must be before any field is read (``openai_schema`` then checks
each field): JSON (``Content-Type`` absent or JSON; ``text/plain`` is a 415),
at most ``--max-request-bytes`` (a 413 from ``Content-Length`` before a byte
is read, or as soon as the streamed body passes it), an object nested at most
``max_json_depth`` deep, with finite numbers only (``NaN``, ``Infinity`` and
``1e999`` are refused) and strings that are valid Unicode (a lone surrogate
such as ``"\\ud800"`` cannot be encoded as UTF-8, so it is refused here and not
deep inside the tokenizer).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from starlette.requests import ClientDisconnect, Request

from mlxcel_plugin.errors import (
    InvalidRequestError,
    RequestTooLargeError,
    UnsupportedMediaTypeError,
)


def check_media_type(content_type: str | None) -> None:
    """JSON or unspecified (what FastAPI accepts), else 415."""
    if not content_type:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and
                                       media.endswith("+json")):  # fmt: skip
        return
    raise UnsupportedMediaTypeError(
        f"the request body must be JSON (Content-Type: application/json), got {media!r}"
    )


# A prompt character takes at most 12 body bytes (a surrogate-pair escape).
MAX_BODY_BYTES_PER_CHAR = 12
# Room for what is not prompt text (sampling fields, JSON syntax).
BODY_SLACK_BYTES = 64 * 1024


def body_limit(max_request_bytes: int, max_prompt_chars: int | None) -> int:
    """``--max-request-bytes``, or less when no prompt of ``max_prompt_chars`` needs that much."""
    if max_prompt_chars is None:
        return max_request_bytes
    return min(max_request_bytes, max_prompt_chars * MAX_BODY_BYTES_PER_CHAR + BODY_SLACK_BYTES)


def _too_large(limit: int) -> RequestTooLargeError:
    return RequestTooLargeError(f"the request body is over the server's {limit}-byte limit "
                                "(--max-request-bytes, or what the model's context can hold)")


def _declared(request: Request) -> tuple[str | None, bytes | None]:
    """Content-Type and Content-Length, read straight from the scope (hot path)."""
    content_type = length = None
    for name, value in request.scope["headers"]:
        if name == b"content-type":
            content_type = value.decode("latin-1")
        elif name == b"content-length":
            length = value
    return content_type, length


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused (413) as soon as it is known to pass ``limit`` bytes."""
    content_type, declared = _declared(request)
    check_media_type(content_type)
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size, more = [], 0, True
    while more:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        more = message.get("more_body", False)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _refuse_constant(name: str) -> Any:
    raise InvalidRequestError(f"the request body has {name}; JSON numbers must be finite")


# Above this the quick scan's C loops would hold the GIL longer than the walk takes.
_SCAN_BYTES = 64 * 1024
# One decoder: json.loads with arguments would build a new one per request.
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)
# A number the parser turns into inf has a 3-digit exponent or over 308 digits
# (two searches: one alternation is several times slower).
_BIG_EXPONENT = re.compile(rb"[eE][+]?\d{3}")
_LONG_NUMBER = re.compile(rb"\d{309}")


def _needs_walk(raw: bytes, max_depth: int) -> bool:
    """False when ``raw`` cannot hold what ``check_tree`` refuses (most bodies: one scan).

    A lone surrogate needs a ``\\u`` escape (UTF-8 cannot carry one), depth needs
    that many brackets, a non-finite number an overflowing literal.
    """
    return (b"\\u" in raw or raw.count(b"[") + raw.count(b"{") > max_depth
            or _BIG_EXPONENT.search(raw) is not None
            or (len(raw) > 308 and _LONG_NUMBER.search(raw) is not None))  # fmt: skip


def parse_json_body(raw: bytes, max_depth: int) -> dict[str, Any]:
    """``raw`` (UTF-8, -16 or -32, as ``json.loads`` reads bytes) as a JSON object, checked."""
    try:
        encoding = json.detect_encoding(raw)
        body = _DECODER.decode(raw.decode(encoding))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise InvalidRequestError("the request body is nested too deeply") from exc
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    # Big bodies are walked anyway (Python: the GIL is shared), small ones scanned first.
    if len(raw) > _SCAN_BYTES or not encoding.startswith("utf-8") or _needs_walk(raw, max_depth):
        check_tree(body, max_depth)
    return body


def _bad_string(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check_string(text: str) -> None:
    if _bad_string(text):
        raise InvalidRequestError("the request body has a string that is not valid Unicode "
                                  "(a lone surrogate)")


def check_tree(body: Any, max_depth: int) -> None:
    """Depth, finite floats and valid strings everywhere in ``body`` (keys too)."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            _check_string(value)
        elif isinstance(value, float):
            if not math.isfinite(value):
                _refuse_constant("a number too large to be finite")
        elif isinstance(value, dict | list):
            if depth > max_depth:
                raise InvalidRequestError(f"the request body nests deeper than {max_depth} levels")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_string(key)
                stack.append((item, depth + 1))
