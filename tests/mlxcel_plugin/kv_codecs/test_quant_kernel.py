"""The compiled decoder of quantized rows writes the cache bytes the NumPy decoder writes:
the same bits for unrotated rows, within float32 rounding of each other for rotated ones
(then stored: a unit in the last place at most, or a row's float32 rounding where a sum
cancels to near zero), and nothing at all for a block whose indices would leave its
arrays."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from mlxcel_plugin.kv_codecs import (
    ChunkLayout,
    GroupQuantCodec,
    from_float32,
    quant_kernel,
    to_float32,
)
from mlxcel_plugin.kv_codecs.floats import F16_MAX
from mlxcel_plugin.kv_codecs.groups import DimGroups

ROWS, TOKENS = 4 * 300, 300  # four heads of 300 tokens: exact sink rows, token runs cut short


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def test_the_kernel_is_built_wherever_a_c_compiler_is():
    if compiler() is None:
        pytest.skip("no C compiler on PATH: the install leaves the NumPy decoder")
    assert quant_kernel.available()


needs_kernel = pytest.mark.skipif(not quant_kernel.available(), reason="kernel not built")


def model_like(dtype: str, seed: int, loud: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((ROWS, 128)).astype("<f4") * rng.uniform(0.1, 4.0, 128)
    values[:, [5, 70]] += 20  # channels sitting off zero, as keys have
    if loud:  # near float16's largest: the decoder must clip
        values = values / np.abs(values).max() * (F16_MAX * 0.999)
    return from_float32(values.astype("<f4"), dtype)


def decode_both(monkeypatch, codec, array, dtype, tensor):
    """(kernel's decode, NumPy's decode) of one encoded chunk."""
    body, meta = codec.encode(array, dtype, ChunkLayout(tensor, TOKENS, 0))
    compiled = codec.decode(bytes(body), meta, array.shape, dtype)
    with monkeypatch.context() as patch:
        patch.setattr(quant_kernel, "decode_block", lambda *args, **kwargs: False)
        numpy = codec.decode(bytes(body), meta, array.shape, dtype)
    return compiled, numpy, meta


# One unit in the last place of each dtype, relative to the value.
UNIT = {"bfloat16": 2.0**-7, "float16": 2.0**-10, "float32": 2.0**-22}


def assert_close(compiled: np.ndarray, numpy: np.ndarray, dtype: str) -> None:
    """Each value within a unit in its last place, or within float32 rounding of its row's
    largest value (a sum of a rotation block that cancels to near zero)."""
    got, want = to_float32(compiled, dtype), to_float32(numpy, dtype)
    row_scale = np.abs(want).max(axis=1, keepdims=True)
    assert np.all(np.abs(got - want) <= UNIT[dtype] * np.abs(want) + 2.0**-20 * row_scale)


@needs_kernel
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("tensor", ["k", "v"])
@pytest.mark.parametrize("bits,rotate", [(8, True), (8, False), (4, False)])
def test_the_kernel_decodes_what_numpy_decodes(monkeypatch, dtype, tensor, bits, rotate):
    codec = GroupQuantCodec(bits, rotate=rotate)
    array = model_like(dtype, seed=bits + len(tensor))
    compiled, numpy, meta = decode_both(monkeypatch, codec, array, dtype, tensor)
    assert ("h" in meta) == rotate
    if rotate:  # butterflies and a BLAS product sum in different orders
        assert_close(compiled, numpy, dtype)
        if dtype != "float32":  # stored in half precision, most sums round alike
            assert np.mean(compiled == numpy) > 0.5
    else:
        assert np.array_equal(compiled.view(np.uint8), numpy.view(np.uint8))
    exact = np.arange(ROWS) % TOKENS == 0  # the attention sink travels exact
    assert np.array_equal(compiled[exact], array[exact])


@needs_kernel
@pytest.mark.parametrize("tensor", ["k", "v"])
def test_values_near_float16s_largest_clip_alike(monkeypatch, tensor):
    codec = GroupQuantCodec(8)
    array = model_like("float16", seed=3, loud=True)
    compiled, numpy, _ = decode_both(monkeypatch, codec, array, "float16", tensor)
    assert np.isfinite(compiled.astype(np.float32)).all()
    assert_close(compiled, numpy, "float16")


@needs_kernel
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rounding_into_half_precision_matches_numpy_bit_for_bit(dtype):
    """One value per row (code 1 x its scale): normals, float16 subnormals, exact ties."""
    rng = np.random.default_rng(7)
    tiny = np.float32(2.0**-24) * np.arange(0, 2048, 0.5, dtype=np.float32)  # ties included
    values = np.concatenate([tiny, -tiny, rng.standard_normal(4096).astype(np.float32) * 100,
                             np.float32([F16_MAX, -F16_MAX, 2.0**-14, 1 + 2.0**-11])])
    width = 8
    codes = np.ones((values.size, width), dtype=np.int8)
    out = np.empty((values.size, width), dtype=np.uint16)
    done = quant_kernel.decode_block(codes, True, DimGroups(width, values.size, width),
                                     values, None, 0, float("inf"), out, None, dtype)
    assert done
    if dtype == "float16":
        want = values.astype(np.float16).view(np.uint16)
    else:  # nearest, ties away from zero (the NumPy decoder's rounded_for_storage)
        want = ((values.view(np.uint32) + np.uint32(0x8000)) >> 16).astype(np.uint16)
    assert np.array_equal(out, np.repeat(want[:, None], width, axis=1))


@needs_kernel
def test_a_block_whose_indices_leave_its_arrays_is_not_decoded():
    width, rows = 128, 64
    codes = np.ones((rows, width), dtype=np.int8)
    out = np.zeros((rows, width), dtype=np.uint16)
    groups = DimGroups(64, rows, width)
    short = np.ones(groups.count - 1, dtype=np.float32)  # one scale short of the rows
    assert not quant_kernel.decode_block(codes, True, groups, short, None, 64, 1e30, out, None,
                                         "bfloat16")
    scales = np.ones(groups.count, dtype=np.float32)
    past_end = np.arange(rows, dtype=np.int64) + 1  # the last row would land past `out`
    assert not quant_kernel.decode_block(codes, True, groups, scales, None, 64, 1e30, out,
                                         past_end, "bfloat16")
    assert not out.any()
    assert quant_kernel.decode_block(codes, True, groups, scales, None, 64, 1e30, out, None,
                                     "bfloat16")
    assert out.any()


@needs_kernel
def test_float32_rows_past_the_largest_value_clip_only_when_asked():
    width, rows = 16, 4
    codes = np.full((rows, width), 127, dtype=np.int8)
    scales = np.full(rows, np.float32(3e38))  # 127 x 3e38 overflows float32
    groups = DimGroups(width, rows, width)
    for limit, finite in ((float(np.finfo(np.float32).max), True), (float("inf"), False)):
        out = np.zeros((rows, width), dtype=np.float32)
        assert quant_kernel.decode_block(codes, True, groups, scales, None, 0, limit, out, None,
                                         "float32")
        assert np.isfinite(out).all() == finite
