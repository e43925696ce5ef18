"""Server-sent events framing for OpenAI streams (``data: {...}\\n\\n``)."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
# Proxies (nginx) must not buffer token streams.
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def dumps(obj: Any) -> str:
    """Compact, key-order-preserving JSON: bodies are byte-comparable across modes."""
    return _ENCODER.encode(obj)


def event(obj: Any) -> bytes:
    return f"data: {dumps(obj)}\n\n".encode()
