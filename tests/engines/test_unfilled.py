"""SlabCarver: unfilled MLX arrays as views of shared slabs."""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest

from engines import unfilled
from engines.unfilled import SlabCarver, unfilled_vector


@pytest.fixture
def carver() -> SlabCarver:
    return SlabCarver(mx.new_stream(mx.cpu), slab_bytes=1 << 20)


def _address(array: mx.array) -> int:
    return np.array(array, copy=False).ctypes.data


def _span(array: mx.array) -> range:
    start = _address(array)
    return range(start, start + array.nbytes)


def test_carved_arrays_have_the_shape_and_dtype_asked_and_do_not_overlap(carver):
    arrays = carver.arrays((1, 3, 50, 8), np.dtype(np.float16), mx.float16, 2)
    arrays += carver.arrays((1, 3, 7, 8), np.dtype(np.float16), mx.float16, 2)
    assert [a.shape for a in arrays] == [(1, 3, 50, 8)] * 2 + [(1, 3, 7, 8)] * 2
    assert all(a.dtype == mx.float16 for a in arrays)
    spans = sorted((_span(a) for a in arrays), key=lambda r: r.start)
    assert all(a.stop <= b.start for a, b in zip(spans, spans[1:]))
    # One slab: every view starts a whole number of pages after the first.
    assert all((s.start - spans[0].start) % 4096 == 0 for s in spans)


def test_writes_through_the_numpy_view_are_what_mlx_reads(carver):
    first, second = carver.arrays((2, 5), np.dtype(np.float32), mx.float32, 2)
    np.array(first, copy=False)[...] = np.arange(10, dtype=np.float32).reshape(2, 5)
    np.array(second, copy=False)[...] = -1
    assert np.array_equal(np.array(first), np.arange(10, dtype=np.float32).reshape(2, 5))
    assert float(mx.sum(second).item()) == -10.0


def test_small_requests_share_a_slab_and_a_full_slab_is_replaced(carver):
    a, b = carver.arrays((1024,), np.dtype(np.uint16), mx.uint16, 2)
    assert abs(_address(b) - _address(a)) < (1 << 20)  # same slab, next page
    (big,) = carver.arrays((600 * 1024,), np.dtype(np.uint16), mx.uint16, 1)  # 1.2 MiB > slab
    assert big.shape == (600 * 1024,)
    (after,) = carver.arrays((1024,), np.dtype(np.uint16), mx.uint16, 1)
    assert _address(after) not in _span(a) and _address(after) not in _span(b)


def test_a_slab_lives_while_any_view_of_it_does(carver):
    keep, drop = carver.arrays((4096,), np.dtype(np.float32), mx.float32, 2)
    np.array(keep, copy=False)[...] = 7
    del drop
    carver.arrays((300 * 1024,), np.dtype(np.float32), mx.float32, 1)  # moves to a new slab
    gc.collect()
    assert float(mx.max(keep).item()) == 7.0 and float(mx.min(keep).item()) == 7.0


def test_an_mlx_that_cannot_load_from_a_stream_gets_zero_filled_arrays(monkeypatch):
    def refuse(*args, **kwargs):
        raise ValueError("[load_npy] Input must be a file-like object, or string")

    monkeypatch.setattr(unfilled.mx, "load", refuse)
    vector = unfilled_vector(16, np.dtype(np.float16), mx.float16, mx.new_stream(mx.cpu))
    assert vector.shape == (16,) and vector.dtype == mx.float16
    assert not np.array(vector).any()


def test_the_header_only_stream_leaves_the_data_bytes_as_found():
    stream = unfilled._HeaderOnly(4, np.dtype(np.float32))
    head = bytearray(128)
    n = stream.readinto(head)
    assert head.startswith(b"\x93NUMPY") and n == 128
    data = bytearray(b"\xaa" * 16)
    assert stream.readinto(data) == 16 and data == bytearray(b"\xaa" * 16)
    assert stream.readinto(bytearray(8)) == 0  # past the end
