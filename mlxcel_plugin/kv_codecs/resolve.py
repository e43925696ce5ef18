"""Codec name resolution: a registered name as-is, or ``int8+lz4`` composed of registered ones.

The codecs themselves are registered through ``mlxcel_register_kv_codecs``
(the core's are in ``mlxcel_plugin.builtin_plugin``); this module keeps no list.
"""

from __future__ import annotations

from collections.abc import Mapping

from mlxcel_plugin.kv_codecs.base import CodecError, KVCodec, UnknownCodec
from mlxcel_plugin.kv_codecs.chain import MAX_STAGES, ChainCodec

MAX_CODEC_NAME = 128


def resolve_codec(name: object, registered: Mapping[str, KVCodec]) -> KVCodec:
    """The codec for ``name``: registered as-is, or a ``+`` chain of registered ones."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_CODEC_NAME:
        raise UnknownCodec(f"codec name must be a short string, got {name!r}")
    if name in registered:
        return registered[name]
    parts = name.split("+")
    missing = [part for part in parts if part not in registered]
    if len(parts) == 1 or missing or len(parts) > MAX_STAGES:
        known = ", ".join(sorted(registered)) or "none"
        raise UnknownCodec(f"unknown codec {name!r}; registered: {known}")
    try:
        return ChainCodec([registered[part] for part in parts])
    except CodecError as exc:
        raise UnknownCodec(f"codec {name!r} cannot be composed: {exc.message}") from exc
