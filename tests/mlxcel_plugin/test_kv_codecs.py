"""KV codecs: LZ4 keep-if-smaller, quantization error bounds and layout, chains, bf16."""

from __future__ import annotations

import numpy as np
import pytest

from mlxcel_plugin.kv_codecs import (
    CodecError,
    CorruptChunk,
    GroupQuantCodec,
    IdentityCodec,
    Lz4Codec,
    UnknownCodec,
    builtin_codecs,
    from_float32,
    resolve_codec,
    to_float32,
)
from mlxcel_plugin.testing.caches import make_tensor

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


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_quantization_error_is_half_a_step_in_float32(bits, head_dim):
    codec = GroupQuantCodec(bits)
    array = chunk("float32", head_dim=head_dim)
    body, meta = codec.encode(array, "float32")
    decoded = codec.decode(body, meta, array.shape, "float32")
    step = group_max(array, 64) / codec.qmax
    # Half a quantization step, plus float32 rounding of scale and product.
    assert np.all(np.abs(decoded - array) <= 0.5 * step * (1 + 1e-5))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_quantization_error_bound_in_half_precision(bits, dtype):
    codec = GroupQuantCodec(bits)
    array = chunk(dtype)
    body, meta = codec.encode(array, dtype)
    decoded = to_float32(codec.decode(body, meta, array.shape, dtype), dtype)
    original = to_float32(array, dtype)
    bound = codec.profile.relative_error * group_max(original, 64)
    assert np.all(np.abs(decoded - original) <= bound)


def test_int8_mean_error_is_far_below_the_bound():
    codec = GroupQuantCodec(8)
    array = chunk("float32", rows=256)
    body, meta = codec.encode(array, "float32")
    error = np.abs(codec.decode(body, meta, array.shape, "float32") - array)
    assert error.mean() < 0.01 * np.abs(array).mean()


@pytest.mark.parametrize(("bits", "ratio"), [(8, 128 / 66), (4, 128 / 34)])
def test_quantized_size_for_fp16_head_dim_128(bits, ratio):
    codec = GroupQuantCodec(bits)
    array = chunk("float16", rows=64, head_dim=128)
    body, meta = codec.encode(array, "float16")
    assert meta == {"g": 64, "s": "f2"}  # float16 scales for float16 data
    assert array.nbytes / len(body) == pytest.approx(ratio)
    assert codec.profile.ratio == pytest.approx(ratio)


def test_int4_layout_is_scales_then_low_nibble_first():
    codec = GroupQuantCodec(4, group_size=4)
    # max|x| = 7, so the scale is 1 and codes equal values.
    array = np.array([[-7.0, 7.0, 0.0, 1.0]], dtype="<f4")
    body, meta = codec.encode(array, "float32")
    assert meta == {"g": 4}
    scale = np.float32(1.0).tobytes()
    # code + 8: 1, 15, 8, 9 -> bytes 0xF1, 0x98
    assert bytes(body) == scale + bytes([0xF1, 0x98])
    assert np.array_equal(codec.decode(body, meta, array.shape, "float32"), array)


def test_int4_handles_an_odd_element_count():
    codec = GroupQuantCodec(4, group_size=64)
    array = chunk("float32", rows=3, head_dim=5)
    body, meta = codec.encode(array, "float32")
    assert meta == {"g": 5}  # 5 is not a multiple of 64: groups are whole rows
    assert len(body) == 3 * 4 + 8
    decoded = codec.decode(body, meta, array.shape, "float32")
    assert np.all(np.abs(decoded - array) <= group_max(array, 5) / 14 * (1 + 1e-5))


def test_quantization_of_zeros_is_exact():
    codec = GroupQuantCodec(8)
    zeros = np.zeros((4, 64), dtype="<f2")
    body, meta = codec.encode(zeros, "float16")
    assert np.array_equal(codec.decode(body, meta, zeros.shape, "float16"), zeros)


def test_quantization_refuses_non_finite_values():
    array = chunk("float32")
    array[3, 5] = np.inf
    with pytest.raises(CodecError):
        GroupQuantCodec(8).encode(array, "float32")


def test_quantization_refuses_hostile_scales():
    codec = GroupQuantCodec(8)
    array = chunk("float16", rows=1, head_dim=64)
    body, meta = codec.encode(array, "float16")
    huge = np.float32(1e30).tobytes() + bytes(body)[4:]
    with pytest.raises(CorruptChunk):
        codec.decode(huge, meta, array.shape, "float16")


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


@pytest.mark.parametrize(("dtype", "kind"), [("float16", "f2"), ("bfloat16", "bf16")])
def test_int8_on_half_precision_is_at_least_1_9x_smaller(dtype, kind):
    codec = GroupQuantCodec(8)
    array = chunk(dtype, rows=256, head_dim=64)
    body, meta = codec.encode(array, dtype)
    assert meta["s"] == kind and array.nbytes / len(body) >= 1.9


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


def test_half_scales_are_rounded_up_so_the_group_max_never_clips():
    codec = GroupQuantCodec(8)
    # 1000 / 127 is not a float16; rounding it down would clip 1000 to 127 steps below it.
    array = np.linspace(-1000, 1000, 64, dtype="<f2").reshape(1, 64)
    body, meta = codec.encode(array, "float16")
    decoded = codec.decode(body, meta, array.shape, "float16").astype("<f4")
    assert np.abs(decoded - array.astype("<f4")).max() <= codec.profile.relative_error * 1000


def test_refuses_a_scale_kind_that_does_not_match_the_dtype():
    codec = GroupQuantCodec(8)
    body, meta = codec.encode(chunk("float16"), "float16")
    with pytest.raises(CorruptChunk):
        codec.decode(body, {**meta, "s": "bf16"}, chunk("float16").shape, "float16")
