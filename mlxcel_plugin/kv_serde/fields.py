"""Typed reads of peer-supplied header maps; every bad value is a MalformedHandoff.

msgpack hands us arbitrary nesting; nothing is trusted before it passes here.
(``bool`` is an ``int`` in Python, so ints refuse it explicitly.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mlxcel_plugin.kv_serde.errors import MalformedHandoff

MAX_ID_CHARS = 256
MAX_LAYERS = 4096
MAX_TOKENS = 1 << 24  # far above any context length; the assembler's limits are tighter
MAX_META_ITEMS = 16
INT64_MAX = 2**63 - 1
_MISSING = object()


def as_map(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise MalformedHandoff(f"{what} must be a map, got {type(value).__name__}")
    return value


def get_int(data: Mapping[str, Any], key: str, lo: int = 0, hi: int = INT64_MAX) -> int:
    value = data.get(key, _MISSING)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise MalformedHandoff(f"field {key!r} must be an int in [{lo}, {hi}], got {value!r:.80}")
    return value


def get_optional_int(data: Mapping[str, Any], key: str, lo: int, hi: int) -> int | None:
    if data.get(key) is None:
        return None
    return get_int(data, key, lo, hi)


def get_str(data: Mapping[str, Any], key: str, max_chars: int = MAX_ID_CHARS) -> str:
    value = data.get(key, _MISSING)
    if not isinstance(value, str) or not 0 < len(value) <= max_chars:
        raise MalformedHandoff(f"field {key!r} must be a non-empty string, got {value!r:.80}")
    return value


def get_optional_str(
    data: Mapping[str, Any], key: str, max_chars: int = MAX_ID_CHARS
) -> str | None:
    if data.get(key) is None:
        return None
    return get_str(data, key, max_chars)


def get_float(data: Mapping[str, Any], key: str, lo: float, hi: float) -> float:
    value = data.get(key, _MISSING)
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not lo <= value <= hi:
        raise MalformedHandoff(f"field {key!r} must be a number in [{lo}, {hi}], got {value!r:.80}")
    return float(value)


def get_optional_float(data: Mapping[str, Any], key: str, lo: float, hi: float) -> float | None:
    if data.get(key) is None:
        return None
    return get_float(data, key, lo, hi)


def get_bool(data: Mapping[str, Any], key: str) -> bool:
    value = data.get(key, _MISSING)
    if not isinstance(value, bool):
        raise MalformedHandoff(f"field {key!r} must be a bool, got {value!r:.80}")
    return value


def as_int_list(
    value: Any, what: str, max_len: int, lo: int = 0, hi: int = INT64_MAX
) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or len(value) > max_len:
        raise MalformedHandoff(f"{what} must be a list of at most {max_len} ints")
    for item in value:
        if not isinstance(item, int) or isinstance(item, bool) or not lo <= item <= hi:
            raise MalformedHandoff(f"{what} holds {item!r:.80}, not an int in [{lo}, {hi}]")
    return tuple(value)


def get_int_list(
    data: Mapping[str, Any], key: str, max_len: int, lo: int = 0, hi: int = INT64_MAX
) -> tuple[int, ...]:
    return as_int_list(data.get(key, []), f"field {key!r}", max_len, lo, hi)


def get_str_list(data: Mapping[str, Any], key: str, max_len: int) -> tuple[str, ...]:
    value = data.get(key, _MISSING)
    if not isinstance(value, list | tuple) or len(value) > max_len:
        raise MalformedHandoff(f"field {key!r} must be a list of at most {max_len} strings")
    if not all(isinstance(item, str) and 0 < len(item) <= MAX_ID_CHARS for item in value):
        raise MalformedHandoff(f"field {key!r} must hold non-empty strings")
    return tuple(value)


def get_scalar_map(data: Mapping[str, Any], key: str) -> dict[str, Any]:
    """A small flat map of scalars (cache meta such as RotatingKVCache's keep/max_size)."""
    value = as_map(data.get(key, {}), f"field {key!r}")
    if len(value) > MAX_META_ITEMS:
        raise MalformedHandoff(f"field {key!r} has more than {MAX_META_ITEMS} items")
    for name, item in value.items():
        if not isinstance(name, str) or len(name) > 64:
            raise MalformedHandoff(f"field {key!r} has a bad key {name!r:.80}")
        scalar = item is None or isinstance(item, bool | int | float)
        if not scalar and not (isinstance(item, str) and len(item) <= MAX_ID_CHARS):
            raise MalformedHandoff(f"field {key!r}[{name!r}] must be a scalar")
    return dict(value)
