"""The compiled one-pass decoder of group-quantized rows (``dequant_kernel.c``), if built.

``pip install`` builds it where a C compiler is found (``setup.py``: optional, so an
install without one still succeeds); without it ``decode_block`` returns False and the
codec decodes in NumPy passes (``quant_decode``), ~2x the CPU. Everything the C loop
indexes is checked here first, against the arrays' own sizes: a hostile body can fail its
handoff, never read or write outside these arrays.
"""

from __future__ import annotations

import ctypes
import importlib.util
import math
from functools import cache

import numpy as np

from mlxcel_plugin.kv_codecs.groups import DimGroups, TokenGroups

MAX_HEAD_DIM = 1024  # the C loop's row buffer
_MODES = {"float32": 0, "bfloat16": 1, "float16": 2}
_POINTER = ctypes.c_void_p


@cache
def _kernel() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("mlxcel_plugin.kv_codecs._dequant_kernel")
    if spec is None or not spec.origin:
        return None
    try:
        library = ctypes.CDLL(spec.origin)  # CDLL: the GIL is released during calls
    except OSError:
        return None
    function = library.decode_rows
    function.restype = ctypes.c_int
    function.argtypes = [_POINTER, ctypes.c_int64, ctypes.c_int, ctypes.c_int, _POINTER,
                         _POINTER, _POINTER, ctypes.c_int, ctypes.c_int, ctypes.c_float,
                         ctypes.c_float, _POINTER, _POINTER, ctypes.c_int]
    return library


def available() -> bool:
    """Whether the compiled decoder was built and loads."""
    return _kernel() is not None


def decode_block(codes: np.ndarray, signed: bool, groups: DimGroups | TokenGroups,
                 scales: np.ndarray, minimums: np.ndarray | None, rotation: int,
                 limit: float, out: np.ndarray, dest: np.ndarray | None, dtype: str) -> bool:
    """Decode one block's quantized rows (``codes``: one integer per value) into rows
    ``dest`` of ``out`` (``[rows, head_dim]``: the storage's bits, or float32), clipped to
    +-``limit``; False (nothing written) where the kernel is not built or does not take
    this block, and the NumPy passes must run instead."""
    kernel = _kernel()
    width = out.shape[1] if out.ndim == 2 else 0
    if kernel is None or dtype not in _MODES or not 0 < width <= MAX_HEAD_DIM:
        return False
    rows = codes.size // width
    group, first_group = _group_starts(groups, rows, width)
    wanted = out.dtype == (np.float32 if dtype == "float32" else np.uint16)
    if not (wanted and out.flags.c_contiguous and codes.size == rows * width
            and codes.itemsize == 1 and first_group.size == rows
            and all(_fits(steps, first_group, width // group)
                    for steps in (scales, minimums) if steps is not None)
            and _lands_within(dest, rows, len(out))):
        return False
    codes = np.ascontiguousarray(codes).view(np.uint8)
    scales, minimums = _aligned(scales), _aligned(minimums)
    dest = np.ascontiguousarray(dest, dtype=np.int64) if dest is not None else None
    norm = np.float32(1 / math.sqrt(rotation)) if rotation else np.float32(1)
    status = kernel.decode_rows(
        _address(codes), rows, width, 128 if signed else 0, _address(scales),
        _address(minimums), _address(first_group), group, rotation, norm, limit,
        _address(out), _address(dest), _MODES[dtype])
    return status == 0


def _group_starts(groups: DimGroups | TokenGroups, rows: int, width: int
                  ) -> tuple[int, np.ndarray]:
    """(values per scale, or 1 for one scale per channel; each row's first scale's index)."""
    if isinstance(groups, DimGroups):
        per_row = width // groups.size
        return groups.size, np.arange(rows, dtype=np.int64) * per_row
    runs = np.repeat(np.arange(groups.starts.size, dtype=np.int64), groups.lengths)
    return 1, runs[:rows] * width


def _fits(per_group: np.ndarray, first_group: np.ndarray, per_row: int) -> bool:
    """Every row's scales (or minimums) lie within ``per_group``."""
    if per_group.dtype != np.float32 or per_group.ndim != 1:
        return False
    return not first_group.size or (
        first_group.min() >= 0 and first_group.max() + per_row <= per_group.size)


def _lands_within(dest: np.ndarray | None, rows: int, out_rows: int) -> bool:
    """Every decoded row lands in ``out`` (``dest`` None: row for row)."""
    if dest is None:
        return rows == out_rows
    return dest.size == rows and (not rows or 0 <= dest.min() <= dest.max() < out_rows)


def _aligned(array: np.ndarray | None) -> np.ndarray | None:
    return None if array is None else np.require(array, np.float32, ["C", "A"])


def _address(array: np.ndarray | None) -> int | None:
    return None if array is None else array.ctypes.data
