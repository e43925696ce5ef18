"""Group-wise quantization (int8, int4) of K/V chunks.

The scheme follows KIVI, chosen by measurement on SmolLM2 (greedy-token
agreement, see ``loadtests/bench_kv_agreement.py``):

* keys: one group per channel per ``token_group`` tokens of a head,
  asymmetric (group minimum + scale) — keys have outlier channels that would
  set the step of a whole row, and many channels sit off zero;
* values: one group per ``group_size`` values of a row, symmetric for int8
  (scale only, to stay within ~0.05 bytes of metadata per element on fp16),
  asymmetric for int4 (where one more level matters);
* the first ``exact_tokens`` tokens of every head travel unquantized (the
  attention sink; see ``groups``);
* int8 first rotates the other rows (keys and values) with an orthonormal
  Walsh–Hadamard transform in blocks of up to 64 values (``rotation``), and
  quantizes the rotated rows as above; decode rotates back. Keys whose rotated
  error would exceed the codec's bound (one element far louder than its
  token run), and rows too close to the dtype's largest value, go unrotated.

On SmolLM2 (fp32 cache, 20 chat prompts, teacher-forced) KIVI grouping cut the
mean change of the top-1/top-2 logit gap from 0.031 to 0.011 for int8 (casting
the cache to bfloat16 gives 0.008) and from 0.58 to 0.19 for int4. Rotating
int8 rows cut it further at the same size: 0.0113 -> 0.0086 on the benchmark's
10 prompts, 0.0120 -> 0.0095 on 30 (bfloat16: 0.0078). Rotation makes the
worst case of a single element looser (``profile.relative_error``: up to
block / 2 steps), the typical error smaller. int4 did not gain greedy
agreement from it (teacher-forced) and stays unrotated.

Without a layout (``encode(array, dtype)``) the codec cannot tell K from V or
heads apart: it quantizes as it does values, with no exact rows.

Body layout: exact rows (raw, the tensor's own dtype), then group minimums
(asymmetric only; in the tensor's own dtype, rounded down where it cannot hold
a rotated minimum exactly; codes count from the stored minimum), then
scales, then codes — int8 as bytes (signed when symmetric), int4 packed two per
byte, even element in the low nibble (``code + 8`` when symmetric). Rows of a
group are in chunk order; token groups are channel-minor (``[group, head_dim]``).

Meta (msgpack map): ``g`` group size (values along head_dim, or tokens); ``s``
scale width (absent: ``<f4``; float16 data gets ``<f2`` and bfloat16 data
bfloat16 scales, rounded up so no code clips, unless a scale does not fit);
``a: "t"`` groups run along tokens; ``z: true`` asymmetric; ``t``, ``r``, ``x``
tokens per head, the token index of row 0 and the exact leading tokens; ``h``
the Hadamard block the quantized rows were rotated in (a power of two up to 64
dividing head_dim; absent: not rotated, the format before rotation). A map
with only ``g`` and ``s`` is the original format (symmetric, along head_dim).
Lossy: never chosen by the adaptive selector unless the config allows it —
exact parity with a single node needs lossless.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from mlxcel_plugin.kv_codecs.base import (
    Buffer,
    ChunkLayout,
    CodecError,
    CodecProfile,
    CorruptChunk,
    storage_dtype,
)
from mlxcel_plugin.kv_codecs.floats import (
    F32_MAX,
    finite_max,
    from_float32,
    round_down,
    to_float32,
)
from mlxcel_plugin.kv_codecs.groups import DimGroups, TokenGroups, TokenSpan
from mlxcel_plugin.kv_codecs.quant_blocks import (
    BlockCursor,
    block_starts,
    blocks,
    column_extent,
    place_rows,
)
from mlxcel_plugin.kv_codecs.quant_format import (
    ChunkFormat,
    effective_group,
    pack_codes,
    unpack_codes,
    widen_scales,
)
from mlxcel_plugin.kv_codecs.rotation import MAX_BLOCK, rotate, rotation_block

# Re-exported: callers imported the float helpers from here before they had a module.
__all__ = ["GroupQuantCodec", "finite_max", "from_float32", "round_down", "to_float32"]

_SCALE = np.dtype("<f4")
SCALE_F4, SCALE_F2, SCALE_BF16 = "f4", "f2", "bf16"
_SCALE_DTYPES = {SCALE_F4: _SCALE, SCALE_F2: np.dtype("<f2"), SCALE_BF16: np.dtype("<u2")}
_F16_MIN_NORMAL = 2.0**-14  # below it a float16 scale loses precision


class GroupQuantCodec:
    def __init__(
        self,
        bits: int,
        group_size: int = 64,
        token_group: int = 128,
        exact_tokens: int = 1,
        rotate: bool | None = None,
    ):
        if bits not in (4, 8):
            raise CodecError(f"bits must be 4 or 8, got {bits}")
        self.bits = bits
        self.group_size = group_size
        self.token_group = token_group
        self.exact_tokens = exact_tokens
        self.qmax = (1 << (bits - 1)) - 1  # symmetric: 127 or 7
        self.levels = (1 << bits) - 1  # asymmetric: 255 or 15
        # int8 cannot afford a value minimum within ~0.05 bytes/element; int4 needs it.
        self.asymmetric_values = bits == 4
        # int8 rotates K/V rows (measured on SmolLM2); int4, measured the same way, does not gain.
        self.rotate = bits == 8 if rotate is None else rotate
        # Worst case of a rotated element: half a step in each of the block's values.
        self.rotated_error = MAX_BLOCK * (1 + 2.0**-7) / (2 * self.qmax) if self.rotate else 0.0
        self.name = f"int{bits}"
        self.lossless = False
        self.profile = CodecProfile(
            ratio=self._nominal_ratio(),
            # bench_kv_agreement.py, SmolLM2's caches cast to fp16, 2 x86 cores (fp32: int8
            # encodes at ~525 and decodes at ~720 MB/s).
            encode_bytes_per_s=200e6 if bits == 8 else 290e6,
            decode_bytes_per_s=290e6 if bits == 8 else 330e6,
            # Half a step of rounding (an asymmetric step is range / levels <= 2 max|x| /
            # (2 qmax + 1)), plus half-precision rounding of scale and output (2**-7 at most);
            # rotated rows: up to block / 2 steps of a rotated group (see ``rotation``).
            relative_error=max(0.5 / self.qmax, self.rotated_error) + 2.0**-8,
        )

    def _nominal_ratio(self) -> float:
        """fp16 bytes / encoded bytes for a long prompt (metadata of K and V averaged)."""
        key_meta = 4 / self.token_group  # fp16 minimum + scale per channel per token group
        value_meta = (4 if self.asymmetric_values else 2) / self.group_size
        return 2 / (self.bits / 8 + (key_meta + value_meta) / 2)

    def chunk_format(self, head_dim: int, layout: ChunkLayout | None) -> ChunkFormat:
        if layout is None:
            group = effective_group(head_dim, self.group_size)
            return ChunkFormat(group, False, self.asymmetric_values, None)
        span = TokenSpan(layout.tokens, layout.first_token, min(self.exact_tokens, layout.tokens))
        rotation = rotation_block(head_dim) if self.rotate else 0
        if layout.tensor == "k":
            return ChunkFormat(self.token_group, True, True, span, rotation)
        group = effective_group(head_dim, self.group_size)
        return ChunkFormat(group, False, self.asymmetric_values, span, rotation)

    def encode(
        self, array: np.ndarray, dtype: str, layout: ChunkLayout | None = None
    ) -> tuple[Buffer, dict[str, Any]]:
        head_dim = array.shape[-1]
        fmt = self.chunk_format(head_dim, layout)
        rows = array.size // head_dim
        array = array.reshape(rows, head_dim)
        starts = block_starts(fmt, rows, head_dim)
        encoded = self._encode_blocks(array, fmt, dtype, starts) if fmt.rotation else None
        if encoded is None:
            fmt = replace(fmt, rotation=0)
            encoded = self._encode_blocks(array, fmt, dtype, starts)
        kind, body = encoded
        meta = fmt.to_meta()
        if kind != SCALE_F4:
            meta["s"] = kind
        return body, meta

    def _encode_blocks(
        self, array: np.ndarray, fmt: ChunkFormat, dtype: str, starts: list[int]
    ) -> tuple[str, bytes] | None:
        """(scale kind, body) of the chunk, encoded block by block (``quant_blocks``);
        None as ``_encode_rows``."""
        rows, head_dim = array.shape
        checked = fmt.rotation and fmt.along_tokens
        extent = column_extent(array, fmt, dtype) if checked else None
        sections = []
        for block in blocks(fmt, rows, head_dim, starts):
            part, exact = array[block.start : block.stop], block.exact
            exact_part = part[exact].tobytes() if exact is not None else b""
            values = to_float32(part[~exact] if exact is not None else part, dtype)
            encoded = self._encode_rows(values, block.groups, block.fmt, dtype, extent)
            if encoded is None:
                return None
            sections.append((encoded[0], exact_part, *encoded[1:]))
        if len({section[0] for section in sections}) > 1:  # scales narrowed unlike: one pass
            return self._encode_blocks(array, fmt, dtype, [0])
        parts = zip(*(section[1:] for section in sections), strict=True)  # by section
        return sections[0][0], b"".join(b"".join(part) for part in parts)

    def _encode_rows(
        self,
        values: np.ndarray,
        groups: DimGroups | TokenGroups,
        fmt: ChunkFormat,
        dtype: str,
        column_extent: np.ndarray | None = None,
    ) -> tuple[str, bytes, bytes, bytes] | None:
        """(scale kind, minimums, scales, codes) of the quantized rows; None where a rotation
        does not fit ``dtype`` or (keys) breaks the error bound: then send them unrotated."""
        work = values
        if fmt.rotation:
            work = rotate(values, fmt.rotation)
            # Half the range keeps rotated minimums and ranges finite in the dtype.
            if not np.abs(work).max(initial=0.0) <= finite_max(dtype) / 2:
                return None
        stored_minimums, minimums, scales = self._group_ranges(work, groups, fmt.asymmetric, dtype)
        kind, stored, scales = self._narrow_scales(scales, dtype, fmt.asymmetric)
        codes = self._quantize(work, groups, minimums, scales)
        if fmt.rotation and fmt.along_tokens:
            # A rotated channel mixes every channel of its block over a token run, so a
            # quiet element's error follows the loudest: check it against the bound.
            decoded = groups.view(codes) * groups.expand(scales) + groups.expand(minimums)
            error = decoded - work
            if not self._within_rotated_bound(values, error, fmt.rotation, column_extent):
                return None
        minimum_part = stored_minimums.tobytes() if fmt.asymmetric else b""
        return kind, minimum_part, stored.tobytes(), pack_codes(codes, self.bits, fmt.asymmetric)

    def _within_rotated_bound(
        self, values: np.ndarray, error: np.ndarray, block: int, column_extent: np.ndarray
    ) -> bool:
        """Every element's error within ``rotated_error`` of its row's or column's max |x|
        (``column_extent``: over the whole chunk)."""
        if not values.size:
            return True
        error = np.abs(rotate(error.reshape(values.shape), block))
        extent = np.maximum(np.abs(values).max(axis=1, keepdims=True), column_extent)
        return bool(np.all(error <= self.rotated_error * extent))

    def _group_ranges(
        self, values: np.ndarray, groups: DimGroups | TokenGroups, asymmetric: bool, dtype: str
    ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray]:
        """(minimums as stored, the same as float32, float32 scales; None, None, scales where
        symmetric); refuses inf/nan."""
        if asymmetric:
            low, high = groups.reduce(values, np.minimum), groups.reduce(values, np.maximum)
            # A stored minimum at or below the true one: codes stay within [0, levels].
            with np.errstate(over="ignore", invalid="ignore"):
                stored_low = round_down(low, dtype)
                low = to_float32(stored_low, dtype)
                scales = ((high - low) / self.levels).astype(_SCALE)
            finite = np.isfinite(scales).all() and np.isfinite(low).all()
        else:
            stored_low, low = None, None
            scales = (groups.reduce(np.abs(values), np.maximum) / self.qmax).astype(_SCALE)
            finite = np.isfinite(scales).all()
        if not finite:
            raise CodecError(f"{self.name}: tensor holds inf/nan, cannot quantize")
        return stored_low, low, scales

    def _quantize(
        self,
        values: np.ndarray,
        groups: DimGroups | TokenGroups,
        minimums: np.ndarray | None,
        scales: np.ndarray,
    ) -> np.ndarray:
        inverse = np.divide(1.0, scales, out=np.zeros_like(scales), where=scales > 0)
        grouped = groups.view(values)
        if minimums is None:
            codes = np.rint(grouped * groups.expand(inverse))
            return np.clip(codes, -self.qmax, self.qmax, out=codes)
        codes = np.rint((grouped - groups.expand(minimums)) * groups.expand(inverse))
        return np.clip(codes, 0, self.levels, out=codes)

    def _max_scale(self, dtype: str, asymmetric: bool) -> float:
        """The largest scale an encoder of ``dtype`` data produces (an asymmetric range
        spans up to twice the dtype's max), with slack for float32 rounding."""
        reach = finite_max(dtype) if dtype != "bfloat16" else F32_MAX
        steps = self.levels if asymmetric else self.qmax
        return (2 if asymmetric else 1) * reach / steps * (1 + 2.0**-20)

    def _narrow_scales(
        self, scales: np.ndarray, dtype: str, asymmetric: bool
    ) -> tuple[str, np.ndarray, np.ndarray]:
        """(kind, scales as stored, the same as float32): half width where exact enough."""
        limit = self._max_scale(dtype, asymmetric)
        if dtype == "bfloat16":
            bits = scales.view("<u4")
            # Round up (never down: a smaller scale would clip the group's max).
            up = ((bits.astype(np.uint64) + 0xFFFF) >> 16).astype("<u2")
            widened = (up.astype("<u4") << 16).view("<f4")
            if (widened <= limit).all():
                return SCALE_BF16, up, widened
        elif dtype == "float16":
            half = scales.astype("<f2")
            half = np.where(half.astype("<f4") < scales, np.nextafter(half, np.inf), half)
            widened = half.astype("<f4")
            usable = (widened == 0) | (widened >= _F16_MIN_NORMAL)
            if usable.all() and (widened <= limit).all():
                return SCALE_F2, half.astype("<f2"), widened
        return SCALE_F4, scales, scales

    def decode(
        self, data: Buffer, meta: Mapping[str, Any], shape: tuple[int, ...], dtype: str
    ) -> np.ndarray:
        head_dim = shape[-1] if shape else 0
        count = math.prod(shape)
        if not head_dim or count % head_dim:
            raise CorruptChunk(f"{self.name}: cannot decode shape {shape}")
        out = np.empty((count // head_dim, head_dim), dtype=storage_dtype(dtype))
        self.decode_into(data, meta, out, dtype)
        return out

    def decode_into(self, data: Buffer, meta: Mapping[str, Any], out: np.ndarray,
                    dtype: str) -> None:
        """``decode`` straight into ``out`` ([rows, head_dim], the storage dtype): the
        receiver's own rows, so no fresh array is faulted in and copied (``KVCodec``)."""
        rows, head_dim = out.shape
        count = rows * head_dim
        fmt = ChunkFormat.from_meta(meta, head_dim)
        scale_dtype = self._scale_dtype(meta, dtype)
        exact, groups = fmt.split(rows, head_dim)
        exact_count = int(exact.sum()) * head_dim if exact is not None else 0
        quantized = count - exact_count
        sections = self._sections(data, fmt, exact_count, groups, quantized, scale_dtype, dtype)
        exact_values, minimums, scales, packed = sections
        scales = widen_scales(scales)
        self._check_ranges(scales, minimums, dtype, fmt.asymmetric)
        codes = unpack_codes(packed, quantized, self.bits, fmt.asymmetric)
        used = BlockCursor()
        for block in blocks(fmt, rows, head_dim, block_starts(fmt, rows, head_dim)):
            exact_part, group_part, code_part = used.advance(block, head_dim)
            groups = block.groups
            values = groups.view(codes[code_part].astype("<f4").reshape(-1, head_dim))
            values = values * groups.expand(scales[group_part])
            if minimums is not None:
                values += groups.expand(minimums[group_part])
            values = self._rotated_back(values.reshape(-1, head_dim), block.fmt, dtype)
            place_rows(out[block.start : block.stop], block.exact, exact_values[exact_part],
                       values, dtype)

    def _rotated_back(self, values: np.ndarray, fmt: ChunkFormat, dtype: str) -> np.ndarray:
        if fmt.rotation:
            values = rotate(values, fmt.rotation)
        if fmt.asymmetric or fmt.rotation:  # a minimum or a rotation can leave the range
            limit = finite_max(dtype)
            np.clip(values, -limit, limit, out=values)
        return values

    def _sections(
        self,
        data: Buffer,
        fmt: ChunkFormat,
        exact_count: int,
        groups: DimGroups | TokenGroups,
        quantized: int,
        scale_dtype: np.dtype,
        dtype: str,
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
        """(exact values, minimums as float32 or None, stored scales, packed codes)."""
        width = storage_dtype(dtype).itemsize
        sizes = (
            exact_count * width,
            groups.count * width if fmt.asymmetric else 0,
            groups.count * scale_dtype.itemsize,
            quantized if self.bits == 8 else (quantized + 1) // 2,
        )
        if len(data) != sum(sizes):
            raise CorruptChunk(f"{self.name}: body is {len(data)} bytes, expected {sum(sizes)}")
        offsets = np.cumsum((0, *sizes))
        raw = np.frombuffer(data, dtype=np.uint8)
        parts = [raw[offsets[i] : offsets[i + 1]] for i in range(4)]
        exact_values = parts[0].view(storage_dtype(dtype))
        minimums = None
        if fmt.asymmetric:
            minimums = to_float32(parts[1].view(storage_dtype(dtype)), dtype)
        return exact_values, minimums, parts[2].view(scale_dtype), parts[3]

    def _scale_dtype(self, meta: Mapping[str, Any], dtype: str) -> np.dtype:
        kind = meta.get("s", SCALE_F4) if isinstance(meta, Mapping) else SCALE_F4
        allowed = {SCALE_F4, SCALE_F2 if dtype == "float16" else SCALE_BF16}
        if kind not in allowed or (kind == SCALE_BF16 and dtype != "bfloat16"):
            raise CorruptChunk(f"{self.name}: scale kind {kind!r:.20} for {dtype} data")
        return _SCALE_DTYPES[kind]

    def _check_ranges(
        self, scales: np.ndarray, minimums: np.ndarray | None, dtype: str, asymmetric: bool
    ) -> None:
        """A scale or minimum no encoder of ``dtype`` data can produce means a corrupt body."""
        with np.errstate(invalid="ignore"):
            ok = bool(np.all(scales >= 0)) and bool(
                np.all(scales <= self._max_scale(dtype, asymmetric))
            )
        if minimums is not None:
            ok = ok and bool(np.isfinite(minimums).all())
        if not ok:
            raise CorruptChunk(f"{self.name}: scales out of range for {dtype}")
