"""int8's cheaper paths keep the format and the bound: blocks of 16, the proof before the
exact key check, decoding without a clip, the float helpers, and bodies of the old encoder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mlxcel_plugin.kv_codecs import ChunkLayout, GroupQuantCodec, from_float32, to_float32
from mlxcel_plugin.kv_codecs.floats import (
    BF16_MAX,
    F16_MAX,
    float16_bits,
    float16_to_float32,
    rounded_for_storage,
)
from mlxcel_plugin.kv_codecs.groups import TokenGroups
from mlxcel_plugin.kv_codecs.quant_decode import needs_clip
from mlxcel_plugin.kv_codecs.quant_encode import group_extremes, group_ranges, quantize
from mlxcel_plugin.kv_codecs.rotation import ENCODE_BLOCK, ENCODE_BLOCKS, hadamard, rotate
from mlxcel_plugin.kv_codecs.rotation_bound import exact_check, surely_within

GOLDEN = Path(__file__).with_name("int8_h64_golden.json")


def keys_like_a_model(rows: int, seed: int, outliers: bool) -> np.ndarray:
    """[rows, 128] float32: per-channel scales, and (``outliers``) loud channels sitting off
    zero plus single tokens 50x louder than their run, as real keys have."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, 128)).astype("<f4") * rng.uniform(0.1, 4.0, 128)
    if outliers:
        values[:, [3, 40, 77]] = values[:, [3, 40, 77]] * 8 + 30
        hits = rng.integers(0, rows, rows // 40), rng.integers(0, 128, rows // 40)
        values[hits] *= 50
    return values.astype("<f4")


def extent(array: np.ndarray) -> np.ndarray:
    magnitude = np.abs(array)
    return np.maximum(magnitude.max(axis=1, keepdims=True), magnitude.max(axis=0))


@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("tensor", ["k", "v"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_decoded_within_the_stated_bound_on_model_shaped_chunks(outliers, tensor, dtype):
    codec = GroupQuantCodec(8)
    array = from_float32(keys_like_a_model(4 * 700, seed=1, outliers=outliers), dtype)
    body, meta = codec.encode(array, dtype, ChunkLayout(tensor, 700, 0))
    decoded = codec.decode(bytes(body), meta, array.shape, dtype)
    want, got = to_float32(array, dtype), to_float32(decoded, dtype)
    assert np.all(np.abs(got - want) <= codec.profile.relative_error * extent(want))
    assert np.abs(got - want).mean() < (0.015 if outliers else 0.01) * np.abs(want).mean()


def test_an_old_encoders_body_rotated_in_blocks_of_64_still_decodes():
    golden = json.loads(GOLDEN.read_text())
    shape = (golden["rows"], golden["head_dim"])
    original = np.frombuffer(bytes.fromhex(golden["input"]), dtype="<u2").reshape(shape)
    codec = GroupQuantCodec(8)
    for chunk in golden["chunks"].values():
        assert chunk["meta"]["h"] == 64
        decoded = codec.decode(bytes.fromhex(chunk["body"]), chunk["meta"], shape, "bfloat16")
        before = np.frombuffer(bytes.fromhex(chunk["decoded"]), dtype="<u2").reshape(shape)
        # The same values, up to the last bit on an exact tie (see rounded_for_storage).
        assert np.abs(decoded.astype(np.int32) - before.astype(np.int32)).max() <= 1
        want, got = to_float32(original, "bfloat16"), to_float32(decoded, "bfloat16")
        assert np.all(np.abs(got - want) <= codec.profile.relative_error * extent(want))


def test_new_encoders_rotate_keys_in_16_and_values_in_64_which_any_decoder_accepts():
    array = from_float32(keys_like_a_model(64, seed=2, outliers=False), "bfloat16")
    for tensor, block in (("k", 16), ("v", 64)):
        _, meta = GroupQuantCodec(8).encode(array, "bfloat16", ChunkLayout(tensor, 64, 0))
        assert meta["h"] == ENCODE_BLOCKS[tensor] == block


@pytest.mark.parametrize("seed", range(12))
def test_the_proof_never_accepts_what_the_exact_check_rejects(seed):
    rng = np.random.default_rng(seed)
    values = keys_like_a_model(256, seed, outliers=True)
    values[rng.integers(0, 256, 6)] *= rng.uniform(1, 400)  # whole loud tokens too
    groups = TokenGroups(int(rng.choice([16, 64, 128])), np.arange(256), 128, 0)
    codec = GroupQuantCodec(8)
    work = rotate(values, ENCODE_BLOCK)
    low, high = group_extremes(work, groups, True)
    _, minimums, scales = group_ranges(low, high, codec.levels, "float32", "int8")
    codes = quantize(work, groups, minimums, scales, (0, codec.levels))
    decoded = codes * groups.expand(scales) + groups.expand(minimums)
    column = np.abs(values).max(axis=0)
    for bound in (codec.rotated_error, codec.rotated_error / 8, codec.rotated_error / 64):
        exact = exact_check(values, work, decoded, ENCODE_BLOCK, bound, lambda: column)
        proof = surely_within(values, work, groups, (scales, minimums), ENCODE_BLOCK, bound)
        assert exact or not proof


def test_token_group_reduce_matches_reduceat_on_uneven_runs():
    rng = np.random.default_rng(0)
    positions = (37 + np.arange(3000)) % 1100
    positions = positions[positions >= 2]  # two exact tokens per head left out
    groups = TokenGroups(128, positions, 8, 2)
    values = rng.standard_normal((positions.size, 8)).astype("<f4")
    for ufunc in (np.minimum, np.maximum):
        want = ufunc.reduceat(values, groups.starts, axis=0)
        assert np.array_equal(groups.reduce(values, ufunc), want)


def test_bfloat16_storage_rounds_to_nearest_and_ties_away_from_zero():
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(100_000) * 10.0 ** rng.integers(-30, 30, 100_000))
    values = np.append(values, [1 + 2.0**-8, -(1 + 2.0**-8), 0.0, BF16_MAX]).astype("<f4")
    stored = np.empty(values.shape, dtype="<u2")
    np.copyto(stored, rounded_for_storage(values.copy(), "bfloat16"), casting="unsafe")
    even = from_float32(values, "bfloat16")
    differs = stored != even
    low_bits = values.view("<u4") & 0xFFFF
    assert np.all(low_bits[differs] == 0x8000)  # only exact ties may differ
    assert stored[-4:].tolist() == [0x3F81, 0xBF81, 0, 0x7F7F]


def test_rotate_writes_the_matrix_product_into_out():
    values = np.random.default_rng(1).standard_normal((40, 128)).astype("<f4")
    out = np.empty_like(values)
    assert rotate(values, 16, out=out) is out
    want = (values.reshape(-1, 16) @ hadamard(16).astype(np.float64)).reshape(values.shape)
    assert np.allclose(out, want, atol=1e-5)


def test_bodies_whose_scales_reach_the_top_of_the_range_are_clipped_finite():
    codec = GroupQuantCodec(8)
    array = np.full((6, 64), 3.0e38, dtype="<f4")
    array[:, ::2] *= -1
    array = from_float32(array, "bfloat16")
    body, meta = codec.encode(array, "bfloat16", ChunkLayout("v", 6, 0))
    decoded = codec.decode(bytes(body), meta, array.shape, "bfloat16")
    assert np.all(np.isfinite(to_float32(decoded, "bfloat16")))
    scales = np.array([BF16_MAX / 100], dtype="<f4")
    assert needs_clip(scales, None, 8, 16, "bfloat16")
    assert not needs_clip(np.array([1.0], dtype="<f4"), None, 8, 16, "bfloat16")


def test_subnormal_scales_quantize_within_range():
    codec = GroupQuantCodec(8)
    array = np.random.default_rng(2).standard_normal((8, 64)).astype("<f4") * 1e-39
    for tensor in ("k", "v"):
        body, meta = codec.encode(array, "float32", ChunkLayout(tensor, 8, 0))
        decoded = codec.decode(bytes(body), meta, array.shape, "float32")
        assert np.all(np.abs(decoded - array) <= codec.profile.relative_error * extent(array))


def test_float16_widens_exactly_as_numpy_casts_every_pattern():
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    finite = halves[np.isfinite(halves)]
    assert np.array_equal(float16_to_float32(finite).view("<u4"),
                          finite.astype("<f4").view("<u4"))
    with_inf = np.array([1.0, np.inf, -2.0], dtype=np.float16)  # NumPy's cast, as it was
    assert np.array_equal(float16_to_float32(with_inf), with_inf.astype("<f4"))


def test_float16_narrows_to_nearest_even_as_numpy_casts():
    rng = np.random.default_rng(4)
    values = rng.standard_normal(200_000) * 10.0 ** rng.uniform(-9, 4.8, 200_000)
    grid = np.arange(1 << 15, dtype=np.uint16).view(np.float16).astype(np.float64)
    grid = grid[np.isfinite(grid) & (grid < F16_MAX)]  # subnormals too
    ties = (grid[:-1] + grid[1:]) / 2  # exactly halfway: ties go to the even neighbour
    values = np.concatenate([values, ties, -ties, [0.0, -0.0, F16_MAX, 65519.0, 1e-40]])
    values = np.clip(values, -65519.0, 65519.0).astype("<f4")
    rows = values[: values.size // 7 * 7].reshape(-1, 7)  # 2-D, as decoded rows are
    bits = float16_bits(rows.copy()).reshape(-1)
    want = rows.reshape(-1).astype(np.float16).view(np.uint16)
    assert np.array_equal(bits.astype(np.uint16), want)


def test_float16_decoding_of_tiny_values_stays_within_the_bound():
    codec = GroupQuantCodec(8)
    array = (np.random.default_rng(5).standard_normal((8, 64)) * 1e-5).astype("<f2")
    for tensor in ("k", "v"):
        body, meta = codec.encode(array, "float16", ChunkLayout(tensor, 8, 0))
        decoded = codec.decode(bytes(body), meta, array.shape, "float16").astype("<f4")
        want = array.astype("<f4")
        assert np.all(np.abs(decoded - want) <= codec.profile.relative_error * extent(want)
                      + 2.0**-25)
