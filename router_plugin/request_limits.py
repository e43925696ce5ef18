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
from typing import Any

from starlette.requests import Request

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


def _too_large(limit: int) -> RequestTooLargeError:
    return RequestTooLargeError(f"the request body is over the server's {limit}-byte limit "
                                "(--max-request-bytes)")  # fmt: skip


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused (413) as soon as it is known to pass ``limit`` bytes."""
    check_media_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _refuse_constant(name: str) -> Any:
    raise InvalidRequestError(f"the request body has {name}; JSON numbers must be finite")


def parse_json_body(raw: bytes, max_depth: int) -> dict[str, Any]:
    """``raw`` as a JSON object, checked by ``check_tree``."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise InvalidRequestError("the request body is nested too deeply") from exc
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
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
