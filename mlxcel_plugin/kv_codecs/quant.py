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
  Walsh–Hadamard transform in blocks of up to 16 values for keys and 64 for
  values (``rotation``; decoders take blocks up to 64, what encoders sent for
  keys before), and quantizes the rotated rows as above; decode rotates back.
  Keys whose rotated error would exceed the codec's bound (one element far
  louder than its token run), and rows too close to the dtype's largest value,
  go unrotated (``rotation_bound``).

On SmolLM2 (fp32 cache, 20 chat prompts, teacher-forced) KIVI grouping cut the
mean change of the top-1/top-2 logit gap from 0.031 to 0.011 for int8 (casting
the cache to bfloat16 gives 0.008) and from 0.58 to 0.19 for int4. Rotating
int8 rows cut it further at the same size: 0.0113 -> 0.0086 on the benchmark's
10 prompts, 0.0120 -> 0.0095 on 30 (bfloat16: 0.0078). Rotation makes the
worst case of a single element looser (``profile.relative_error``: up to
block / 2 steps), the typical error smaller. int4 did not gain greedy
agreement from it (teacher-forced) and stays unrotated. Blocks of 16 cost a
third of 64's rotation CPU. For keys they cost no agreement; for values they did:
on bench_kv_agreement's 10 prompts (fp32 caches) blocks of 16 for both agreed
74.7-82.6% (6-7 of 10 runs identical, two runs), keys 64 / values 16 92.0% (8),
64 for both and keys 16 / values 64 100% (10 of 10);
teacher-forced on those caches the gap moved 0.0097 (16), 0.0084 (64), p99 0.050
against 0.036 (on bfloat16 caches, 20 prompts: 0.0108 against 0.0111, the cast to
bfloat16 alone 0.0075).

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

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from mlxcel_plugin.kv_codecs import quant_kernel
from mlxcel_plugin.kv_codecs.base import (
    Buffer,
    ChunkLayout,
    CodecError,
    CodecProfile,
    CorruptChunk,
    storage_dtype,
)
from mlxcel_plugin.kv_codecs.floats import finite_max, from_float32, round_down, to_float32
from mlxcel_plugin.kv_codecs.groups import DimGroups, TokenGroups, TokenSpan
from mlxcel_plugin.kv_codecs.quant_blocks import (
    Block,
    BlockCursor,
    PieceRows,
    block_starts,
    blocks,
    column_extent,
    cut_at,
    spanning_rows,
)
from mlxcel_plugin.kv_codecs.quant_decode import decode_block_into, needs_clip
from mlxcel_plugin.kv_codecs.quant_encode import (
    SCALE,
    SCALE_BF16,
    SCALE_F2,
    SCALE_F4,
    extremes_reach,
    group_extremes,
    group_ranges,
    max_scale,
    narrow_scales,
    quantize,
)
from mlxcel_plugin.kv_codecs.quant_format import (
    ChunkFormat,
    effective_group,
    pack_codes,
    unpack_codes,
    widen_scales,
)
from mlxcel_plugin.kv_codecs.rotation import (
    ENCODE_BLOCKS,
    MAX_BLOCK,
    is_rotation_block,
    rotate,
    rotation_block,
)
from mlxcel_plugin.kv_codecs.rotation_bound import exact_check, surely_within
from mlxcel_plugin.kv_codecs.scratch import scratch

# Re-exported: callers imported the float helpers from here before they had a module.
__all__ = ["GroupQuantCodec", "finite_max", "from_float32", "round_down", "to_float32"]

_SCALE_DTYPES = {SCALE_F4: SCALE, SCALE_F2: np.dtype("<f2"), SCALE_BF16: np.dtype("<u2")}


class GroupQuantCodec:
    def __init__(
        self,
        bits: int,
        group_size: int = 64,
        token_group: int = 128,
        exact_tokens: int = 1,
        rotate: bool | None = None,
        rotation_cap: int | None = None,
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
        if rotation_cap is not None and not is_rotation_block(rotation_cap, rotation_cap):
            raise CodecError(f"rotation_cap must be a power of two 2..{MAX_BLOCK}")
        # The largest Hadamard block rows rotate in; None: each tensor's ENCODE_BLOCKS.
        self.rotation_cap = rotation_cap
        # Worst case of a rotated element: half a step in each of the block's values. Stated
        # for the largest block a decoder accepts (encoders before this one rotated in 64).
        self.rotated_error = MAX_BLOCK * (1 + 2.0**-7) / (2 * self.qmax) if self.rotate else 0.0
        self.name = f"int{bits}"
        self.lossless = False
        self.profile = CodecProfile(
            ratio=self._nominal_ratio(),
            # bench_kv_codecs.py, one x86 core shared with other work, NumPy's BLAS at one
            # thread: SmolLM2-shaped fp16 KV (the slower dtype; 8B-shaped bf16 int8 runs at
            # ~0.6 GB/s encoding and ~1.2 decoding).
            encode_bytes_per_s=400e6 if bits == 8 else 450e6,
            decode_bytes_per_s=600e6 if bits == 8 else 650e6,
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
        cap = self.rotation_cap or ENCODE_BLOCKS.get(layout.tensor, ENCODE_BLOCKS["v"])
        rotation = rotation_block(head_dim, cap) if self.rotate else 0
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
        extent = functools.cache(lambda: column_extent(array, fmt, dtype))  # only if needed
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
        column_extent: Callable[[], np.ndarray],
    ) -> tuple[str, bytes, bytes, bytes] | None:
        """(scale kind, minimums, scales, codes) of the quantized rows; None where a rotation
        does not fit ``dtype`` or (keys) breaks the error bound: then send them unrotated."""
        work = values
        if fmt.rotation:
            work = rotate(values, fmt.rotation, out=scratch("encode.rotated", values.shape, "<f4"))
        low, high = group_extremes(work, groups, fmt.asymmetric)
        # Half the range keeps rotated minimums and ranges finite in the dtype.
        if fmt.rotation and not extremes_reach(low, high) <= finite_max(dtype) / 2:
            return None
        steps = self.levels if fmt.asymmetric else self.qmax
        stored_minimums, minimums, scales = group_ranges(low, high, steps, dtype, self.name)
        limit = max_scale(dtype, steps, fmt.asymmetric)
        kind, stored, scales = narrow_scales(scales, dtype, limit)
        code_range = (0, self.levels) if fmt.asymmetric else (-self.qmax, self.qmax)
        codes = quantize(work, groups, minimums, scales, code_range)
        if fmt.rotation and fmt.along_tokens:
            proof = (values, work, groups, (scales, minimums), fmt.rotation, self.rotated_error)
            if not surely_within(*proof):
                decoded = groups.view(codes) * groups.expand(scales) + groups.expand(minimums)
                if not exact_check(values, work, decoded, fmt.rotation, self.rotated_error,
                                   column_extent):
                    return None
        minimum_part = stored_minimums.tobytes() if fmt.asymmetric else b""
        return kind, minimum_part, stored.tobytes(), pack_codes(codes, self.bits, fmt.asymmetric)

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
        self.decode_into_pieces(data, meta, [out], dtype)

    def decode_into_pieces(self, data: Buffer, meta: Mapping[str, Any],
                           pieces: list[np.ndarray], dtype: str) -> bool:
        """``decode_into`` rows that sit in ``pieces`` back to back (a receive buffer with
        room: one per head), each block straight into its piece; False (nothing written)
        where the chunk's blocks cannot be cut at the pieces' edges (``cut_at``)."""
        rows, head_dim = sum(len(p) for p in pieces), pieces[0].shape[1]
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
        clip = needs_clip(scales, minimums, self.bits, fmt.rotation, dtype)
        spanned = (spanning_rows(pieces) if len(pieces) > 1 and quant_kernel.available()
                   else None)  # only the compiled decoder takes a span
        if spanned is not None and decode_block_into(
                spanned[0], Block(0, rows, fmt, exact, groups), codes, (scales, minimums),
                exact_values, fmt.rotation, clip, dtype, at=spanned[1]):
            return True
        out = PieceRows(pieces)
        # The compiled decoder keeps each row in L1 whatever the block: one per piece.
        blocked = [0] if quant_kernel.available() else block_starts(fmt, rows, head_dim)
        starts = cut_at(blocked, fmt, rows, head_dim, out.firsts)
        if starts is None:
            return False
        used = BlockCursor()
        for block in blocks(fmt, rows, head_dim, starts):
            exact_part, group_part, code_part = used.advance(block, head_dim)
            block_minimums = minimums[group_part] if minimums is not None else None
            decode_block_into(out.rows(block.start, block.stop), block, codes[code_part],
                              (scales[group_part], block_minimums), exact_values[exact_part],
                              fmt.rotation, clip, dtype)
        return True

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
        limit = max_scale(dtype, self.levels if asymmetric else self.qmax, asymmetric)
        with np.errstate(invalid="ignore"):
            ok = bool(np.all(scales >= 0)) and bool(np.all(scales <= limit))
        if minimums is not None:
            ok = ok and bool(np.isfinite(minimums).all())
        if not ok:
            raise CorruptChunk(f"{self.name}: scales out of range for {dtype}")
