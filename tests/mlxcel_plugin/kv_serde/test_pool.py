"""BufferPool: slabs are lent again only once nothing refers to them."""

import numpy as np

from mlxcel_plugin.cache_lines import CACHE_LINE_BYTES
from mlxcel_plugin.kv_serde import BufferPool

MIB = 1 << 20


def test_a_slab_is_reused_once_every_view_of_it_is_gone():
    pool = BufferPool(16 * MIB)
    array = pool.take_array((1, 2, 1000, 64), np.float16)
    address = array.ctypes.data
    rows = array.reshape(-1, 64)[10:20]
    view = memoryview(rows)
    del array, rows
    assert pool.take(256_000).ctypes.data != address  # the memoryview still holds the slab
    del view
    again = pool.take(256_000)
    assert again.ctypes.data == address and pool.reused == 1


def test_lent_memory_starts_on_a_cache_line():
    pool = BufferPool(16 * MIB)
    first = pool.take(1000)
    array = pool.take_array((3, 7, 5), np.float16)
    del first
    again = pool.take(900)  # the first slab, lent again
    assert pool.reused == 1
    assert all(a.ctypes.data % CACHE_LINE_BYTES == 0 for a in (array, again))


def test_a_slab_is_not_lent_for_much_smaller_requests():
    pool = BufferPool(16 * MIB)
    pool.take(4 * MIB)
    assert pool.take(MIB).nbytes == MIB and pool.reused == 0


def test_the_pool_stays_within_its_bound():
    pool = BufferPool(4 * MIB)
    held = [pool.take(MIB) for _ in range(6)]
    assert pool.held_bytes <= 4 * MIB
    assert all(a.nbytes == MIB for a in held)  # beyond the bound: unpooled memory
    del held
    pool.take(3 * MIB)  # room is made by dropping free slabs
    assert pool.held_bytes <= 4 * MIB


def test_release_free_drops_only_what_nobody_holds():
    pool = BufferPool(16 * MIB)
    lent = pool.take(MIB)
    freed = pool.take(2 * MIB)
    del freed
    assert pool.release_free() >= 2 * MIB
    assert pool.held_bytes >= MIB and lent.nbytes == MIB


def test_pool_size_follows_the_kv_budget_and_the_machine():
    from mlxcel_plugin.kv_serde.pool import DEFAULT_POOL_BYTES, MIN_POOL_BYTES, pool_bytes_for

    gib = 1024 * MIB
    assert pool_bytes_for(4 * gib, machine_bytes=64 * gib) == DEFAULT_POOL_BYTES
    assert pool_bytes_for(512 * MIB, machine_bytes=64 * gib) == 128 * MIB  # a quarter
    assert pool_bytes_for(4 * gib, model_bytes=7 * gib, machine_bytes=8 * gib) == MIN_POOL_BYTES
