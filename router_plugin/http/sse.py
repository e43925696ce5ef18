"""Server-sent events framing for OpenAI streams (``data: {...}\\n\\n``)."""

from __future__ import annotations

import json
from json.encoder import encode_basestring
from typing import Any

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
# Proxies (nginx) must not buffer token streams.
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def dumps(obj: Any) -> str:
    """Compact, key-order-preserving JSON: bodies are byte-comparable across modes."""
    return _ENCODER.encode(obj)


def dumps_str(text: str) -> str:
    """``dumps`` of a str (the function json itself uses with ensure_ascii=False)."""
    return encode_basestring(text)


def event(obj: Any) -> bytes:
    return f"data: {dumps(obj)}\n\n".encode()
