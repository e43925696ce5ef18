"""Encoding a quantized chunk in cache-sized row blocks: same format, same bound, any layout."""

from __future__ import annotations

import numpy as np
import pytest

from mlxcel_plugin.kv_codecs import (
    ChunkLayout,
    GroupQuantCodec,
    from_float32,
    quant,
    quant_blocks,
    quant_kernel,
    to_float32,
)
from mlxcel_plugin.kv_codecs.quant_blocks import block_starts, spanning_rows

HEAD_DIM = 64
LAYOUTS = {  # (tensor, tokens per head, token of row 0, rows): whole heads, mid-head starts
    "k-heads": ("k", 2048, 0, 6144),
    "k-mid": ("k", 3000, 700, 5000),
    "k-tail": ("k", 9000, 1, 4100),
    "v-heads": ("v", 2048, 0, 6144),
    "v-mid": ("v", 3000, 700, 5000),
}


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks of 512 KiB: these layouts (up to 1.5 MiB of float32) then span several."""
    monkeypatch.setattr(quant_blocks, "BLOCK_BYTES", 512 * 1024)


def loud_rows(rows: int, dtype: str, seed: int = 0) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal((rows, HEAD_DIM)).astype("<f4")
    values[:, 3] *= 30.0  # an outlier channel, as real keys have
    return from_float32(values, dtype)


def encode_in_one_pass(codec, array, dtype, layout, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(quant_blocks, "BLOCK_BYTES", 1 << 40)
        return codec.encode(array, dtype, layout)


def boundary_positions(layout: ChunkLayout, starts: list[int]) -> list[int]:
    return [(layout.first_token + start) % layout.tokens for start in starts[1:]]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_blocks_cover_the_chunk_and_start_at_group_boundaries(name):
    tensor, tokens, first, rows = LAYOUTS[name]
    codec = GroupQuantCodec(8)
    layout = ChunkLayout(tensor, tokens, first)
    fmt = codec.chunk_format(HEAD_DIM, layout)
    starts = block_starts(fmt, rows, HEAD_DIM)
    target = quant_blocks.BLOCK_BYTES // (4 * HEAD_DIM)
    assert starts[0] == 0 and len(starts) > 1 and starts == sorted(set(starts))
    assert all(stop - start <= target for start, stop in zip(starts, [*starts[1:], rows],
                                                              strict=True))
    if tensor == "k":  # a head's first token, or a token group's first past the exact ones
        exact = fmt.span.exact
        assert all(p == 0 or (p >= exact and (p - exact) % fmt.group == 0)
                   for p in boundary_positions(layout, starts))


def test_a_chunk_within_one_block_is_one_pass():
    fmt = GroupQuantCodec(8).chunk_format(HEAD_DIM, ChunkLayout("k", 2048, 0))
    assert block_starts(fmt, quant_blocks.BLOCK_BYTES // (4 * HEAD_DIM), HEAD_DIM) == [0]
    assert block_starts(fmt, 6144, HEAD_DIM + 1) == [0]  # odd rows: int4 could not pack


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_blocked_encoding_has_the_one_pass_format_and_bound(bits, dtype, name, monkeypatch):
    tensor, tokens, first, rows = LAYOUTS[name]
    codec = GroupQuantCodec(bits)
    layout = ChunkLayout(tensor, tokens, first)
    array = loud_rows(rows, dtype)
    body, meta = codec.encode(array, dtype, layout)
    whole_body, whole_meta = encode_in_one_pass(codec, array, dtype, layout, monkeypatch)
    assert meta == whole_meta and len(body) == len(whole_body)
    decoded = to_float32(codec.decode(bytes(body), meta, array.shape, dtype), dtype)
    whole = to_float32(codec.decode(bytes(whole_body), whole_meta, array.shape, dtype), dtype)
    want = to_float32(array, dtype)
    magnitude = np.abs(want)
    extent = np.maximum(magnitude.max(axis=1, keepdims=True), magnitude.max(axis=0))
    assert np.all(np.abs(decoded - want) <= codec.profile.relative_error * extent)
    # Blocks round like the one pass, up to the rotation's last bit (BLAS blocks rows its way).
    assert np.abs(decoded - whole).max() <= 2 * codec.profile.relative_error * extent.max()
    assert np.mean(decoded == whole) > 0.99


def test_blocks_narrowing_their_scales_unlike_fall_back_to_one_pass(monkeypatch):
    """float16 scales need a normal float16: a block of tiny values keeps float32 scales,
    a block of ordinary ones would narrow; the chunk then encodes in one pass."""
    codec = GroupQuantCodec(8)
    layout = ChunkLayout("v", 6144, 0)
    values = np.random.default_rng(0).standard_normal((6144, HEAD_DIM)).astype("<f4")
    values[:2048] *= 1e-4
    array = from_float32(values, "float16")
    body, meta = codec.encode(array, "float16", layout)
    assert (body, meta) == encode_in_one_pass(codec, array, "float16", layout, monkeypatch)
    assert "s" not in meta  # float32 scales, as the one pass chose for the whole chunk


def test_no_block_is_a_sliver():
    fmt = GroupQuantCodec(8).chunk_format(HEAD_DIM, ChunkLayout("v", 6144, 0))
    assert block_starts(fmt, 6144, HEAD_DIM) == [0, 2048, 4096]


def head_pieces(buffer: np.ndarray, tokens: int, first: int, rows: int) -> list[np.ndarray]:
    """Rows of a chunk as a buffer with room holds them: one piece per head, each its own
    span of ``buffer`` ([heads, room, head_dim]) with room after the head's tokens."""
    pieces, row = [], first
    while row < first + rows:
        head, token = divmod(row, tokens)
        n = min(first + rows - row, tokens - token)
        pieces.append(buffer[head, token : token + n])
        row += n
    return pieces


@pytest.mark.parametrize("one_call", [True, False])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "k-tail"])  # over several heads
def test_decoding_into_per_head_pieces_writes_the_bytes_a_contiguous_decode_does(
        name, bits, one_call, monkeypatch):
    """A receive buffer with room takes a chunk's rows head by head: the compiled decoder
    takes the whole chunk in one call (the pieces as rows of one span), else each block is
    decoded into its own head's piece (cut at head boundaries); either way the bytes a
    contiguous decode gives, and the room past each head's tokens is never written."""
    tensor, tokens, first, rows = LAYOUTS[name]
    codec = GroupQuantCodec(bits)
    array = loud_rows(rows, "bfloat16", seed=bits)
    body, meta = codec.encode(array, "bfloat16", ChunkLayout(tensor, tokens, first))
    want = codec.decode(body, meta, array.shape, "bfloat16")
    heads = (first + rows - 1) // tokens + 1
    buffer = np.full((heads, tokens + 256, HEAD_DIM), 0xABCD, dtype=want.dtype)
    pieces = head_pieces(buffer, tokens, first, rows)
    assert len(pieces) > 1
    if not one_call:
        monkeypatch.setattr(quant, "spanning_rows", lambda pieces: None)
    calls = []
    decode_block = quant_kernel.decode_block
    monkeypatch.setattr(quant_kernel, "decode_block", lambda *a: calls.append(1) or
                        decode_block(*a))
    assert codec.decode_into_pieces(body, meta, pieces, "bfloat16")
    assert np.concatenate(pieces).tobytes() == want.tobytes()
    assert (buffer[:, tokens:] == 0xABCD).all()
    if quant_kernel.available():
        assert len(calls) == (1 if one_call else len(pieces))


def test_pieces_span_one_view_only_at_whole_rows_after_the_first():
    buffer = np.zeros((3, 10, 4), dtype=np.float32)
    span, at = spanning_rows([buffer[0, 7:], buffer[1, :2], buffer[2, 5:6]])
    assert at.tolist() == [0, 1, 2, 3, 4, 18]  # rows from the first piece's first
    assert span.shape == (19, 4) and span.ctypes.data == buffer.ctypes.data + 7 * 16
    span[at] = 1.0  # only the pieces' rows
    assert buffer[0, 7:].all() and buffer[1, :2].all() and buffer[2, 5].all()
    assert buffer.sum() == 6 * 4
    assert spanning_rows([buffer[1, :2], buffer[0, 7:]]) is None  # before the first
    assert spanning_rows([buffer[0, :2], buffer[1, :2, :2]]) is None  # another width
    assert spanning_rows([buffer[0, :2], buffer[1, :2].astype(np.float64)]) is None
    assert spanning_rows([buffer[0, :2], buffer[1:3, 0]]) is None  # not contiguous rows


@pytest.mark.parametrize("seed", range(4))
def test_token_positions_are_each_rows_token_within_its_head(seed):
    from mlxcel_plugin.kv_codecs.groups import TokenSpan

    rng = np.random.default_rng(seed)
    for _ in range(200):
        tokens = int(rng.integers(1, 300))
        first, rows = int(rng.integers(0, 3 * tokens)), int(rng.integers(0, 1000))
        got = TokenSpan(tokens, first, 1).positions(rows)
        assert got.tolist() == ((first + np.arange(rows)) % tokens).tolist()
