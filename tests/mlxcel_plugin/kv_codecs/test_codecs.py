"""KV codecs: LZ4 keep-if-smaller, quantization groups, error bounds and layout, chains, bf16."""

from __future__ import annotations

import numpy as np
import pytest

from mlxcel_plugin.builtin_plugin import builtin_codecs
from mlxcel_plugin.kv_codecs import (
    ChunkLayout,
    CodecError,
    CorruptChunk,
    GroupQuantCodec,
    IdentityCodec,
    Lz4Codec,
    UnknownCodec,
    from_float32,
    resolve_codec,
    to_float32,
)
from mlxcel_plugin.kv_codecs.quant import round_down
from mlxcel_plugin.kv_codecs.rotation import (
    ENCODE_BLOCK,
    ENCODE_BLOCKS,
    MAX_BLOCK,
    hadamard,
    rotate,
    rotation_block,
)
from mlxcel_plugin.kv_serde import SerializableCacheState
from mlxcel_plugin.testing.caches import make_cache, make_fingerprint, make_header, make_tensor

CODECS = builtin_codecs()


def chunk(dtype: str, rows: int = 64, head_dim: int = 128, smooth: bool = False, seed: int = 0):
    rng = np.random.default_rng(seed)
    return make_tensor(rng, (1, 1, rows, head_dim), dtype, smooth).reshape(rows, head_dim)


def test_identity_body_is_a_view_of_the_tensor():
    array = chunk("float16")
    body, meta = IdentityCodec().encode(array, "float16")
    assert meta == {}
    assert np.shares_memory(np.frombuffer(body, dtype=np.uint8), array)


def test_lz4_sends_incompressible_chunks_raw():
    noise = np.random.default_rng(0).integers(0, 1 << 16, (64, 128), dtype=np.uint16)
    body, meta = Lz4Codec().encode(noise, "bfloat16")
    assert meta == {"c": False}
    assert bytes(body) == noise.tobytes()


def test_lz4_compresses_redundant_chunks():
    zeros = np.zeros((64, 128), dtype="<f2")
    body, meta = Lz4Codec().encode(zeros, "float16")
    assert meta == {"c": True}
    assert len(body) < zeros.nbytes // 50
    assert np.array_equal(Lz4Codec().decode(body, meta, zeros.shape, "float16"), zeros)


@pytest.mark.parametrize("name", ["lz4", "shuffle+lz4"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_lossless_encodings_never_grow(name, dtype):
    codec = resolve_codec(name, CODECS)
    array = chunk(dtype)
    body, _ = codec.encode(array, dtype)
    assert len(body) <= array.nbytes


def test_lz4_refuses_a_corrupt_compressed_body():
    zeros = np.zeros((64, 128), dtype="<f2")
    body, meta = Lz4Codec().encode(zeros, "float16")
    with pytest.raises(CorruptChunk):
        Lz4Codec().decode(b"\xff" * len(body), meta, zeros.shape, "float16")


def test_shuffle_helps_lz4_on_smooth_fp16():
    array = chunk("float16", rows=256, smooth=True)
    plain, _ = resolve_codec("lz4", CODECS).encode(array, "float16")
    shuffled, _ = resolve_codec("shuffle+lz4", CODECS).encode(array, "float16")
    assert len(shuffled) < len(plain)


def group_max(values: np.ndarray, group: int) -> np.ndarray:
    groups = values.reshape(-1, group)
    return np.repeat(np.abs(groups).max(axis=1), group).reshape(values.shape)


def heads(rows: int = 64, kv_heads: int = 3, head_dim: int = 64, dtype: str = "float32", seed=0):
    """A whole layer tensor as the writer chunks it: [kv_heads * rows, head_dim]."""
    rng = np.random.default_rng(seed)
    return make_tensor(rng, (1, kv_heads, rows, head_dim), dtype).reshape(-1, head_dim)


def round_trip(codec, array, dtype, layout=None):
    body, meta = codec.encode(array, dtype, layout)
    return codec.decode(bytes(body), meta, array.shape, dtype), body, meta


def token_group_half_steps(array, tokens, first_row, group, exact, levels):
    """Reference for key groups: half of each (head, channel, token run)'s range / levels."""
    half = np.zeros_like(array)
    positions = (first_row + np.arange(len(array))) % tokens
    row = 0
    while row < len(array):
        if positions[row] < exact:
            row += 1
            continue
        run = group - (positions[row] - exact) % group
        stop = min(row + run, len(array), row + tokens - positions[row])
        block = array[row:stop]
        half[row:stop] = (block.max(axis=0) - block.min(axis=0)) / levels / 2
        row = stop
    return half


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("first_row", [0, 5, 64, 150])
def test_key_groups_run_along_tokens_within_one_head(bits, first_row):
    codec = GroupQuantCodec(bits, token_group=16, rotate=False)
    array = heads(rows=64)[first_row : first_row + 100]
    layout = ChunkLayout("k", 64, first_row)
    decoded, _, meta = round_trip(codec, array, "float32", layout)
    assert meta == {"g": 16, "a": "t", "z": True, "t": 64, "r": first_row % 64, "x": 1}
    half = token_group_half_steps(array, 64, first_row, 16, 1, codec.levels)
    # Half a step of the channel's own run, plus float32 rounding of scale and product.
    assert np.all(np.abs(decoded - array) <= half * (1 + 1e-5) + 1e-6 * np.abs(array))


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quiet_head_keeps_its_own_precision_next_to_a_loud_one(bits):
    codec = GroupQuantCodec(bits)
    array = heads(rows=40, kv_heads=2)
    array[40:] *= 1e4  # head 1 is 10**4 louder; a group spanning both would drown head 0
    decoded, _, _ = round_trip(codec, array, "float32", ChunkLayout("k", 40, 0))
    quiet = np.abs(array[:40]).max()
    assert np.abs(decoded[:40] - array[:40]).max() <= quiet / codec.levels


@pytest.mark.parametrize("tensor", ["k", "v"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_first_token_of_every_head_travels_exact(tensor, dtype):
    codec = GroupQuantCodec(4)
    array = heads(rows=10, dtype=dtype)
    decoded, _, meta = round_trip(codec, array, dtype, ChunkLayout(tensor, 10, 0))
    assert meta["x"] == 1
    assert decoded[0::10].tobytes() == array[0::10].tobytes()
    assert decoded.tobytes() != array.tobytes()  # the rest is quantized


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_value_error_is_half_a_step_in_float32(bits, head_dim):
    codec = GroupQuantCodec(bits, rotate=False)
    array = heads(rows=32, head_dim=head_dim)
    decoded, _, meta = round_trip(codec, array, "float32", ChunkLayout("v", 32, 0))
    assert meta["g"] == 64 and "a" not in meta
    quantized = np.arange(len(array)) % 32 != 0
    if codec.asymmetric_values:
        groups = array[quantized].reshape(-1, 64)
        step = np.ptp(groups, axis=1) / codec.levels
        step = np.repeat(step, 64).reshape(-1, head_dim)
    else:
        step = group_max(array[quantized], 64) / codec.qmax
    error = np.abs(decoded[quantized] - array[quantized])
    assert np.all(error <= 0.5 * step * (1 + 1e-5) + 1e-6 * np.abs(array[quantized]))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("tensor", ["k", "v", None])
def test_quantization_error_bound_in_half_precision(bits, dtype, tensor):
    codec = GroupQuantCodec(bits)
    array = heads(rows=200, dtype=dtype)[100:500]
    layout = ChunkLayout(tensor, 200, 100) if tensor else None
    decoded, _, _ = round_trip(codec, array, dtype, layout)
    got, want = to_float32(decoded, dtype), to_float32(array, dtype)
    magnitude = np.abs(want)
    bound = np.maximum(magnitude.max(axis=1, keepdims=True), magnitude.max(axis=0))
    assert np.all(np.abs(got - want) <= codec.profile.relative_error * bound)


def test_int8_mean_error_is_far_below_the_bound():
    codec = GroupQuantCodec(8)
    array = heads(rows=256)
    for tensor in ("k", "v"):
        decoded, _, _ = round_trip(codec, array, "float32", ChunkLayout(tensor, 256, 0))
        assert np.abs(decoded - array).mean() < 0.01 * np.abs(array).mean()


def test_keys_grouped_along_tokens_beat_rows_on_outlier_channels():
    codec = GroupQuantCodec(8)
    array = heads(rows=256)
    array[:, 3] += 40.0  # an outlier channel sitting off zero, as RoPE'd keys have
    as_key, _, _ = round_trip(codec, array, "float32", ChunkLayout("k", 256, 0))
    as_row, _, _ = round_trip(codec, array, "float32")
    plain = np.delete(np.arange(64), 3)
    key_error = np.abs(as_key - array)[:, plain].mean()
    assert key_error < 0.25 * np.abs(as_row - array)[:, plain].mean()


def key_body_bytes(tokens: int, head_dim: int, width: int, bits: int, group: int) -> int:
    """One whole head of keys: the exact first row, then minimum + scale per channel run."""
    runs = -(-(tokens - 1) // group)
    return head_dim * width + runs * head_dim * 2 * width + (tokens - 1) * head_dim * bits // 8


def value_body_bytes(tokens: int, head_dim: int, width: int, bits: int, group: int) -> int:
    groups = (tokens - 1) * head_dim // group
    per_group = 2 * width if bits == 4 else width  # int4 values also carry a minimum
    return head_dim * width + groups * per_group + (tokens - 1) * head_dim * bits // 8


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("tokens", [1, 29, 257, 1000])
def test_quantized_sizes_for_one_fp16_head(bits, tokens):
    codec = GroupQuantCodec(bits)
    array = heads(rows=tokens, kv_heads=1, dtype="float16")
    key, key_meta = codec.encode(array, "float16", ChunkLayout("k", tokens, 0))
    value, value_meta = codec.encode(array, "float16", ChunkLayout("v", tokens, 0))
    assert key_meta["s"] == value_meta["s"] == "f2"
    assert len(key) == key_body_bytes(tokens, 64, 2, bits, 128)
    assert len(value) == value_body_bytes(tokens, 64, 2, bits, 64)


@pytest.mark.parametrize(("bits", "target"), [(8, 1.9), (4, 3.5)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_layers_shrink_to_target(bits, target, dtype):
    codec = GroupQuantCodec(bits)
    tokens = 1024
    array = heads(rows=tokens, dtype=dtype)
    sizes = [len(codec.encode(array, dtype, ChunkLayout(t, tokens, 0))[0]) for t in "kv"]
    ratio = 2 * array.nbytes / sum(sizes)
    assert ratio >= target
    assert ratio == pytest.approx(codec.profile.ratio, rel=0.01)


def test_int8_without_layout_keeps_the_original_format():
    codec = GroupQuantCodec(8, group_size=4)
    # max|x| = 127, so the scale is 1 and codes equal values.
    array = np.array([[-127.0, 127.0, 0.0, 1.0]], dtype="<f4")
    body, meta = codec.encode(array, "float32")
    assert meta == {"g": 4}
    assert bytes(body) == np.float32(1.0).tobytes() + bytes([0x81, 0x7F, 0x00, 0x01])
    assert np.array_equal(codec.decode(body, meta, array.shape, "float32"), array)


def test_int4_key_layout_is_exact_rows_minimums_scales_then_low_nibble_first():
    codec = GroupQuantCodec(4, token_group=2)
    # One head of 3 tokens, 2 channels; token 0 is exact, tokens 1-2 form one run per channel.
    array = np.array([[9.0, -9.0], [1.0, 0.0], [16.0, 15.0]], dtype="<f4")
    body, meta = codec.encode(array, "float32", ChunkLayout("k", 3, 0))
    assert meta == {"g": 2, "a": "t", "z": True, "t": 3, "r": 0, "x": 1}
    exact = array[0].tobytes()
    minimums = np.array([1.0, 0.0], dtype="<f4").tobytes()
    scales = np.array([1.0, 1.0], dtype="<f4").tobytes()  # ranges 15 and 15 over 15 levels
    # codes: token 1 -> (0, 0), token 2 -> (15, 15); low nibble first
    assert bytes(body) == exact + minimums + scales + bytes([0x00, 0xFF])
    assert np.array_equal(codec.decode(body, meta, array.shape, "float32"), array)


def test_int4_handles_an_odd_element_count():
    codec = GroupQuantCodec(4, group_size=64)
    array = chunk("float32", rows=3, head_dim=5)
    body, meta = codec.encode(array, "float32")
    assert meta == {"g": 5, "z": True}  # 5 is not a multiple of 64: groups are whole rows
    assert len(body) == 3 * (4 + 4) + 8
    decoded = codec.decode(body, meta, array.shape, "float32")
    step = np.ptp(array, axis=1, keepdims=True) / codec.levels
    assert np.all(np.abs(decoded - array) <= 0.5 * step * (1 + 1e-5))


@pytest.mark.parametrize("tensor", ["k", "v", None])
def test_quantization_of_zeros_is_exact(tensor):
    codec = GroupQuantCodec(8)
    zeros = np.zeros((4, 64), dtype="<f2")
    layout = ChunkLayout(tensor, 4, 0) if tensor else None
    decoded, _, _ = round_trip(codec, zeros, "float16", layout)
    assert np.array_equal(decoded, zeros)


@pytest.mark.parametrize("tensor", ["k", "v", None])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_quantization_refuses_non_finite_values(tensor, bad):
    array = chunk("float32")
    array[3, 5] = bad
    layout = ChunkLayout(tensor, 64, 0) if tensor else None
    with pytest.raises(CodecError):
        GroupQuantCodec(8).encode(array, "float32", layout)


def test_quantization_refuses_hostile_scales():
    codec = GroupQuantCodec(8)
    array = chunk("float16", rows=1, head_dim=64)
    body, meta = codec.encode(array, "float16")
    huge = np.float16(60000.0).tobytes() + bytes(body)[2:]
    with pytest.raises(CorruptChunk):
        codec.decode(huge, meta, array.shape, "float16")


def test_key_decode_refuses_a_non_finite_minimum():
    codec = GroupQuantCodec(8)
    array = chunk("float16", rows=8, head_dim=64)
    body, meta = codec.encode(array, "float16", ChunkLayout("k", 8, 0))
    exact_bytes = 64 * 2
    poisoned = bytearray(body)
    poisoned[exact_bytes : exact_bytes + 2] = np.float16(np.nan).tobytes()
    with pytest.raises(CorruptChunk):
        codec.decode(bytes(poisoned), meta, array.shape, "float16")


@pytest.mark.parametrize(
    "change",
    [
        {"r": 8},  # first token beyond the head
        {"t": 0},
        {"x": 9},
        {"a": "d"},
        {"z": "yes"},
        {"t": None},  # token groups without a span
        {"g": 0},
    ],
    ids=str,
)
def test_key_decode_refuses_a_bad_layout_in_meta(change):
    codec = GroupQuantCodec(8)
    array = chunk("float16", rows=8, head_dim=64)
    body, meta = codec.encode(array, "float16", ChunkLayout("k", 8, 0))
    meta = {**meta, **change}
    meta = {key: value for key, value in meta.items() if value is not None}
    with pytest.raises(CorruptChunk):
        codec.decode(body, meta, array.shape, "float16")


def test_value_decode_refuses_a_group_that_does_not_divide_head_dim():
    codec = GroupQuantCodec(8)
    array = chunk("float16", rows=8, head_dim=64)
    body, meta = codec.encode(array, "float16", ChunkLayout("v", 8, 0))
    with pytest.raises(CorruptChunk):
        codec.decode(body, {**meta, "g": 48}, array.shape, "float16")


def test_decoded_values_never_overflow_float16():
    codec = GroupQuantCodec(4)
    array = np.array([[65504.0] * 64, [-65504.0] * 64, [65504.0] * 64], dtype="<f2")
    decoded, _, _ = round_trip(codec, array, "float16", ChunkLayout("k", 3, 0))
    assert np.all(np.isfinite(decoded.astype("<f4")))


def test_bfloat16_round_trips_every_finite_pattern():
    bits = np.arange(1 << 16, dtype=np.uint16)
    finite = bits[np.isfinite(to_float32(bits, "bfloat16"))]
    assert np.array_equal(from_float32(to_float32(finite, "bfloat16"), "bfloat16"), finite)


def test_bfloat16_rounds_to_nearest_even():
    # 1 + 2**-8 is halfway between bf16 1.0 and 1.0078125: ties go to the even (1.0).
    halfway = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8], dtype="<f4")
    assert from_float32(halfway, "bfloat16").tolist() == [0x3F80, 0x3F82]


def test_resolve_returns_registered_codecs_and_builds_chains():
    assert resolve_codec("lz4", CODECS) is CODECS["lz4"]
    chain = resolve_codec("int8+lz4", CODECS)
    assert chain.name == "int8+lz4" and not chain.lossless
    assert chain.profile.ratio == pytest.approx(CODECS["int8"].profile.ratio * 1.05)


@pytest.mark.parametrize("name", ["zstd", "lz4+zstd", "", "+", "lz4+", 7, "x" * 500])
def test_resolve_refuses_unknown_names(name):
    with pytest.raises(UnknownCodec):
        resolve_codec(name, CODECS)


def test_a_lossy_stage_may_only_come_first():
    with pytest.raises(UnknownCodec, match="first stage"):
        resolve_codec("lz4+int8", CODECS)


def test_chain_refuses_a_huge_declared_intermediate():
    chain = resolve_codec("int8+lz4", CODECS)
    array = chunk("float16", rows=4, head_dim=64)
    body, meta = chain.encode(array, "float16")
    with pytest.raises(CorruptChunk):
        chain.decode(body, {**meta, "n": [1 << 40]}, array.shape, "float16")


@pytest.mark.parametrize("tensor", ["k", "v"])
def test_chains_hand_the_layout_to_their_first_stage(tensor):
    chain = resolve_codec("int8+lz4", CODECS)
    array = heads(rows=16, dtype="float16")
    layout = ChunkLayout(tensor, 16, 0)
    body, meta = chain.encode(array, "float16", layout)
    assert meta["s"][0] == CODECS["int8"].encode(array, "float16", layout)[1]
    decoded = chain.decode(body, meta, array.shape, "float16")
    assert decoded.tobytes() == round_trip(CODECS["int8"], array, "float16", layout)[0].tobytes()


def test_the_writer_tells_the_codec_which_tensor_and_token_it_encodes():
    fingerprint = make_fingerprint(num_layers=1, kv_heads=2, head_dim=64, dtype="float16")
    cache = make_cache(fingerprint, 300)
    header = make_header(fingerprint, 300, codec="int8")
    messages = SerializableCacheState(header, cache).to_messages(CODECS["int8"], 16 * 1024)
    chunks = [m.header for m in messages if m.kind == "chunk"]
    for chunk_header in chunks:
        meta = chunk_header["codec_meta"]
        assert meta["t"] == 300 and meta["r"] == chunk_header["row"] % 300
        assert (meta.get("a") == "t") == (chunk_header["tensor"] == "k")


@pytest.mark.parametrize("scale", [1e-7, 65504.0], ids=["tiny", "top-of-range"])
def test_float16_groups_whose_scale_does_not_fit_keep_float32_scales(scale):
    codec = GroupQuantCodec(8)
    array = np.full((4, 64), scale, dtype="<f2")
    array[:, ::2] *= -1
    body, meta = codec.encode(array, "float16")
    assert "s" not in meta
    decoded = codec.decode(body, meta, array.shape, "float16")
    assert np.all(np.isfinite(decoded.astype("<f4")))
    assert np.allclose(decoded.astype("<f4"), array.astype("<f4"), rtol=0.01)


@pytest.mark.parametrize("tensor", ["k", "v", None])
def test_half_scales_are_rounded_up_so_the_group_max_never_clips(tensor):
    codec = GroupQuantCodec(8)
    # 2000 / 255 and 1000 / 127 are not float16s; rounding them down would clip the extremes.
    array = np.linspace(-1000, 1000, 64 * 8, dtype="<f2").reshape(8, 64)
    layout = ChunkLayout(tensor, 8, 0) if tensor else None
    decoded, _, meta = round_trip(codec, array, "float16", layout)
    assert meta["s"] == "f2"
    error = np.abs(decoded.astype("<f4") - array.astype("<f4")).max()
    assert error <= codec.profile.relative_error * 1000


def test_refuses_a_scale_kind_that_does_not_match_the_dtype():
    codec = GroupQuantCodec(8)
    body, meta = codec.encode(chunk("float16"), "float16")
    with pytest.raises(CorruptChunk):
        codec.decode(body, {**meta, "s": "bf16"}, chunk("float16").shape, "float16")


def test_hadamard_is_orthonormal_and_its_own_inverse():
    for size in (2, 16, 64):
        matrix = hadamard(size)
        assert np.allclose(matrix @ matrix, np.eye(size), atol=1e-6)
        assert np.array_equal(matrix, matrix.T)
    values = heads(rows=4)
    for size in (16, 64):
        assert np.allclose(rotate(rotate(values, size), size), values, atol=1e-5)


@pytest.mark.parametrize(("head_dim", "cap", "block"), [
    (64, 16, 16), (128, 16, 16), (24, 16, 8), (5, 16, 0), (64, 64, 64), (128, 64, 64),
    (80, 64, 16), (96, 64, 32),
])
def test_rotation_block_is_the_largest_power_of_two_dividing_head_dim(head_dim, cap, block):
    assert rotation_block(head_dim, cap) == block
    assert rotation_block(head_dim) == rotation_block(head_dim, ENCODE_BLOCK)


@pytest.mark.parametrize(("bits", "rotated"), [(8, True), (4, False)])
@pytest.mark.parametrize("tensor", ["k", "v", None])
def test_int8_rotates_rows_when_it_knows_the_layout(bits, rotated, tensor):
    array = heads(rows=32)
    layout = ChunkLayout(tensor, 32, 0) if tensor else None
    _, meta = GroupQuantCodec(bits).encode(array, "float32", layout)
    assert meta.get("h") == (ENCODE_BLOCKS[tensor] if rotated and tensor else None)


@pytest.mark.parametrize("cap", [ENCODE_BLOCK, MAX_BLOCK])
def test_rotated_values_are_within_half_a_step_of_the_rotated_rows(cap):
    codec = GroupQuantCodec(8, rotation_cap=cap)
    array = heads(rows=32)
    decoded, _, meta = round_trip(codec, array, "float32", ChunkLayout("v", 32, 0))
    assert meta["h"] == cap
    quantized = np.arange(len(array)) % 32 != 0
    want, got = rotate(array[quantized], cap), rotate(decoded[quantized], cap)
    step = group_max(want, 64) / codec.qmax
    assert np.all(np.abs(got - want) <= 0.5 * step * (1 + 1e-4) + 1e-5 * np.abs(want).max())


@pytest.mark.parametrize("cap", [ENCODE_BLOCK, MAX_BLOCK])
def test_rotated_keys_are_within_half_a_step_of_the_rotated_channel_runs(cap):
    codec = GroupQuantCodec(8, token_group=16, rotation_cap=cap)
    array = heads(rows=64)[5:105]
    decoded, _, meta = round_trip(codec, array, "float32", ChunkLayout("k", 64, 5))
    assert meta["h"] == cap
    want = rotate(array, cap)
    half = token_group_half_steps(want, 64, 5, 16, 1, codec.levels)
    exact = (5 + np.arange(len(array))) % 64 == 0
    error = np.abs(rotate(decoded, cap) - want)[~exact]
    assert np.all(error <= half[~exact] * (1 + 1e-4) + 1e-5 * np.abs(want).max())


def test_rotation_shrinks_the_error_of_value_rows_with_an_outlier_channel():
    array = heads(rows=256)
    array[:, 7] *= 30.0  # one loud channel would set the step of every row
    layout = ChunkLayout("v", 256, 0)
    rotated, _, _ = round_trip(GroupQuantCodec(8), array, "float32", layout)
    plain, _, _ = round_trip(GroupQuantCodec(8, rotate=False), array, "float32", layout)
    assert np.abs(rotated - array).mean() < 0.7 * np.abs(plain - array).mean()


def test_keys_go_unrotated_where_rotation_would_break_the_error_bound():
    codec = GroupQuantCodec(8)
    array = np.random.default_rng(0).normal(0, 0.01, (8, 64)).astype("<f4")
    array[1, 0] = 1000.0  # rotated, it would set the step of every channel of token 1's run
    decoded, _, meta = round_trip(codec, array, "float32", ChunkLayout("k", 8, 0))
    assert "h" not in meta
    magnitude = np.abs(array)
    extent = np.maximum(magnitude.max(axis=1, keepdims=True), magnitude.max(axis=0))
    assert np.all(np.abs(decoded - array) <= codec.profile.relative_error * extent)
    assert np.abs(decoded[:, 1:] - array[:, 1:]).max() < 1e-3  # quiet channels keep their step


@pytest.mark.parametrize("tensor", ["k", "v"])
def test_float16_rows_near_the_top_of_the_range_go_unrotated(tensor):
    codec = GroupQuantCodec(8)
    array = np.full((4, 64), 60000.0, dtype="<f2")
    array[:, ::3] *= -1
    decoded, _, meta = round_trip(codec, array, "float16", ChunkLayout(tensor, 4, 0))
    assert "h" not in meta
    assert np.all(np.isfinite(decoded.astype("<f4")))


@pytest.mark.parametrize("tensor", ["k", "v"])
def test_chunks_without_rotation_meta_decode_as_before(tensor):
    array = heads(rows=16, dtype="float16")
    layout = ChunkLayout(tensor, 16, 0)
    old = GroupQuantCodec(8, rotate=False)
    body, meta = old.encode(array, "float16", layout)
    assert "h" not in meta
    new = GroupQuantCodec(8).decode(bytes(body), meta, array.shape, "float16")
    assert new.tobytes() == old.decode(bytes(body), meta, array.shape, "float16").tobytes()


@pytest.mark.parametrize("tensor", ["k", "v"])
@pytest.mark.parametrize("block", [0, 1, 3, 48, 128, "64", True, -64])
def test_decode_refuses_a_bad_rotation_block(tensor, block):
    codec = GroupQuantCodec(8)
    array = chunk("float16", rows=8, head_dim=64)
    body, meta = codec.encode(array, "float16", ChunkLayout(tensor, 8, 0))
    with pytest.raises(CorruptChunk):
        codec.decode(body, {**meta, "h": block}, array.shape, "float16")


def test_decode_refuses_a_rotation_block_that_does_not_divide_head_dim():
    codec = GroupQuantCodec(8)
    array = chunk("float16", rows=8, head_dim=80)
    body, meta = codec.encode(array, "float16", ChunkLayout("v", 8, 0))
    assert meta["h"] == 16
    with pytest.raises(CorruptChunk):
        codec.decode(body, {**meta, "h": 32}, array.shape, "float16")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_round_down_gives_the_largest_stored_value_not_above(dtype):
    values = np.random.default_rng(3).normal(0, 100, 1000).astype("<f4")
    values = np.append(values, [0.0, -0.0, 1e-30, -1e-30]).astype("<f4")
    stored = round_down(values, dtype)
    assert np.all(to_float32(stored, dtype) <= values)
    nearest = to_float32(from_float32(values, dtype), dtype)
    below_or_equal = to_float32(stored, dtype)
    assert np.all((below_or_equal == nearest) | (nearest > values))
