"""ReceiveStock: receive arrays made ahead on the engine thread, taken ready by the next handoff."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engines.receive_stock import BURST_GAP_S, ReceiveStock
from engines.unfilled import mlx_view, unfilled_array

SHAPE = (1, 2, 64, 8)
OTHER = (1, 2, 128, 8)
F16 = np.dtype(np.float16)
NBYTES = 2 * 64 * 8 * 2  # one SHAPE array


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stock_of(max_bytes: int) -> tuple[ReceiveStock, Clock]:
    clock = Clock()
    return ReceiveStock(max_bytes, unfilled_array, clock=clock), clock


def test_a_shape_taken_is_made_ahead_and_the_next_take_gets_it_ready():
    stock, _ = stock_of(1 << 20)
    assert stock.take(SHAPE, F16, mx.float16, 3) == []  # nothing made yet: the caller allocates
    assert stock.restock(1) == 1  # while decoding: a few per engine iteration
    assert stock.restock(100) == 2  # idle: all that are due
    assert stock.restock(100) == 0 and stock.held_bytes == 3 * NBYTES
    ready = stock.take(SHAPE, F16, mx.float16, 4)
    assert len(ready) == 3 and stock.taken == 3 and stock.held_bytes == 0
    for array in ready:  # writable numpy views of an MLX array of their own
        assert array.shape == SHAPE and array.dtype == F16 and array.flags.writeable
        array[...] = 7
        as_mlx = mlx_view(array)
        assert as_mlx is not None and as_mlx.shape == SHAPE
        assert np.array_equal(np.array(as_mlx), np.full(SHAPE, 7, F16))
    assert len({a.ctypes.data for a in ready}) == 3


def test_the_stock_follows_the_last_burst_of_takes():
    stock, clock = stock_of(1 << 20)
    stock.take(SHAPE, F16, mx.float16, 2)
    clock.now += 0.01
    stock.take(SHAPE, F16, mx.float16, 2)  # the same burst: 4 wanted
    stock.restock(100)
    assert stock.held_bytes == 4 * NBYTES
    clock.now += BURST_GAP_S + 1
    assert len(stock.take(SHAPE, F16, mx.float16, 1)) == 1  # a new burst of 1 after a gap
    clock.now += BURST_GAP_S + 1
    stock.take(SHAPE, F16, mx.float16, 1)  # the burst of 1 has ended: 1 wanted from now
    stock.restock(100)
    assert stock.held_bytes == 1 * NBYTES


def test_max_bytes_bounds_the_stock_and_the_latest_shape_comes_first():
    stock, clock = stock_of(4 * NBYTES)
    stock.take(SHAPE, F16, mx.float16, 3)
    stock.restock(100)
    assert stock.held_bytes == 3 * NBYTES
    clock.now += 1
    stock.take(OTHER, F16, mx.float16, 2)  # 2 x 2 NBYTES: room is made from the older shape
    stock.restock(100)
    assert stock.held_bytes <= 4 * NBYTES
    assert len(stock.take(OTHER, F16, mx.float16, 2)) == 2
    assert stock.take(SHAPE, F16, mx.float16, 3) == []  # its arrays made room for OTHER's
    stock.clear()
    assert stock.held_bytes == 0


def test_no_stock_beyond_a_zero_bound():
    stock, _ = stock_of(0)
    stock.take(SHAPE, F16, mx.float16, 2)
    assert stock.restock(100) == 0 and stock.held_bytes == 0


def test_mlx_cache_of_freed_buffers_counts_in_the_bound():
    """The receive pool bounds the stock and MLX's cache together (docs/memory.md)."""
    stock = ReceiveStock(4 * NBYTES, unfilled_array, cached_bytes=lambda: 3 * NBYTES)
    stock.take(SHAPE, F16, mx.float16, 3)
    assert stock.restock(100) == 1 and stock.held_bytes == NBYTES
