"""What one handoff layer holds: named arrays, each with a shape, a dtype and a growing axis.

An engine describes its caches from the cache objects themselves (for mlx-lm:
``make_prompt_cache`` and the state after a probe prefill), never from config
keys, so one wire format carries every cache kind (docs/architectures.md):
plain and rotating K/V, MLA K/V of different widths, SSM conv and recurrent
state (fixed size: no growing axis), quantized K/V (packed words, scales and
biases). A chunk is rows of one array seen as ``[rows, shape[-1]]``; only
float arrays marked ``coded`` go through the handoff's codec, the others
travel raw (a lossy codec must not touch packed words or recurrent state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlxcel_plugin.kv_serde import fields as f
from mlxcel_plugin.kv_serde.errors import MalformedHandoff

# Logical dtype name -> storage dtype (little-endian; bfloat16 is its raw bits).
ARRAY_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "uint32": np.dtype("<u4"),
}
MAX_ARRAYS = 16
MAX_DIMS = 6
MAX_DIM = 1 << 24
KV_NAMES = ("k", "v")


@dataclass(frozen=True)
class ArraySpec:
    """One array of a layer; ``shape[grow_axis]`` is 0 here and the layer's tokens on the wire."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    grow_axis: int | None = None
    coded: bool = False  # whether the handoff's codec may encode it (float K/V only)

    @property
    def storage(self) -> np.dtype:
        return ARRAY_DTYPES[self.dtype]

    @property
    def width(self) -> int:
        return self.shape[-1]

    @property
    def row_bytes(self) -> int:
        return self.width * self.storage.itemsize

    def shape_for(self, tokens: int) -> tuple[int, ...]:
        if self.grow_axis is None:
            return self.shape
        shape = list(self.shape)
        shape[self.grow_axis] = tokens
        return tuple(shape)

    def rows(self, tokens: int) -> int:
        return math.prod(self.shape_for(tokens)[:-1])

    def nbytes(self, tokens: int) -> int:
        return self.rows(tokens) * self.row_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "grow_axis": self.grow_axis, "coded": self.coded}

    @classmethod
    def from_dict(cls, data: Any) -> ArraySpec:
        data = f.as_map(data, "array spec")
        shape = f.get_int_list(data, "shape", MAX_DIMS, 0, MAX_DIM)
        grow = f.get_optional_int(data, "grow_axis", 0, max(0, len(shape) - 2))
        dtype = f.get_str(data, "dtype", 16)
        if dtype not in ARRAY_DTYPES or len(shape) < 2:
            raise MalformedHandoff(f"array spec {dtype!r} {shape} is not a known 2+-d layout")
        zeros = [i for i, n in enumerate(shape) if n == 0]
        if zeros != ([grow] if grow is not None else []):
            raise MalformedHandoff(f"array spec shape {shape}: only the growing axis may be 0")
        coded = bool(data.get("coded", False)) and dtype != "uint32"
        return cls(f.get_str(data, "name", 32), tuple(shape), dtype, grow, coded)


@dataclass(frozen=True)
class LayerSpec:
    """One handoff layer: the cache class and its arrays, in wire order."""

    kind: str
    arrays: tuple[ArraySpec, ...]

    @property
    def grows(self) -> bool:
        return any(a.grow_axis is not None for a in self.arrays)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.arrays)

    def array(self, name: str) -> ArraySpec:
        for spec in self.arrays:
            if spec.name == name:
                return spec
        raise MalformedHandoff(f"a {self.kind} layer has no array {name!r:.40}")

    def nbytes(self, tokens: int) -> int:
        return sum(a.nbytes(tokens) for a in self.arrays)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "arrays": [a.to_dict() for a in self.arrays]}

    @classmethod
    def from_dict(cls, data: Any) -> LayerSpec:
        data = f.as_map(data, "layer spec")
        raw = data.get("arrays")
        # No arrays: a cache kind the engine cannot export (refused by ``check_supported``).
        if not isinstance(raw, list | tuple) or len(raw) > MAX_ARRAYS:
            raise MalformedHandoff(f"a layer spec lists at most {MAX_ARRAYS} arrays")
        arrays = tuple(ArraySpec.from_dict(item) for item in raw)
        if len({a.name for a in arrays}) != len(arrays):
            raise MalformedHandoff("a layer spec names an array twice")
        return cls(f.get_str(data, "kind", 64), arrays)


def kv_layer(kind: str, kv_heads: int, head_dim: int, dtype: str) -> LayerSpec:
    """A plain K/V layer ``[1, kv_heads, T, head_dim]`` (what older peers describe implicitly)."""
    def spec(name: str) -> ArraySpec:
        return ArraySpec(name, (1, kv_heads, 0, head_dim), dtype, 2, coded=True)

    return LayerSpec(kind, (spec("k"), spec("v")))


def parse_layers(data: Any, max_layers: int) -> tuple[LayerSpec, ...]:
    """Each layer's spec; a layer described exactly as the one before it shares its spec.

    Why: a decode node parses the fingerprint of every handoff's begin on its event loop,
    and most models' layers are alike (32 of an 8B model: ~0.3 ms a begin, parsed one
    by one; ~0.07 ms so); comparing two small maps is C, parsing one is many Python calls.
    """
    if not isinstance(data, list | tuple) or not 1 <= len(data) <= max_layers:
        raise MalformedHandoff(f"fingerprint layers must list 1 to {max_layers} layers")
    specs: list[LayerSpec] = []
    for i, item in enumerate(data):
        same = i and type(item) is dict and type(data[i - 1]) is dict and item == data[i - 1]
        specs.append(specs[-1] if same else LayerSpec.from_dict(item))
    return tuple(specs)
