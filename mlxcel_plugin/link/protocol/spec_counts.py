"""A node's speculative decoding totals on its TELEMETRY: ``speculative`` (method ->
[proposed, accepted]), absent when the node never speculated (docs/speculative.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlxcel_plugin.link.protocol.frame_codec import MalformedFrame, get_field

MAX_METHODS = 8
MAX_METHOD_CHARS = 16


def spec_counts(header: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """The ``speculative`` field, checked: {} when absent."""
    value = get_field(header, "speculative", dict, {})
    if len(value) > MAX_METHODS:
        raise MalformedFrame(f"more than {MAX_METHODS} speculative methods reported")
    return {_method(name): _pair(counts) for name, counts in value.items()}


def _method(name: Any) -> str:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_METHOD_CHARS:
        raise MalformedFrame("a speculative method name must be a string of 1 to "
                             f"{MAX_METHOD_CHARS} characters")
    return name


def _pair(counts: Any) -> tuple[int, int]:
    ok = isinstance(counts, (list, tuple)) and len(counts) == 2 and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts)
    if not ok or counts[1] > counts[0]:
        raise MalformedFrame("speculative counts must be [proposed, accepted] with "
                             "0 <= accepted <= proposed")
    return int(counts[0]), int(counts[1])
