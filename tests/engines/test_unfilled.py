"""SlabCarver: unfilled MLX memory handed out as numpy views; mlx_view maps them back."""

from __future__ import annotations

import gc
import mmap
import queue
import resource
import threading

import mlx.core as mx
import numpy as np
import pytest

from engines import unfilled
from engines.unfilled import SlabCarver, mlx_view, unfilled_vector
from mlxcel_plugin import huge_pages
from mlxcel_plugin.cache_lines import CACHE_LINE_BYTES


@pytest.fixture
def carver() -> SlabCarver:
    return SlabCarver(mx.new_stream(mx.cpu), slab_bytes=1 << 20)


def _span(buffer: np.ndarray) -> range:
    return range(buffer.ctypes.data, buffer.ctypes.data + buffer.nbytes)


def test_carved_buffers_have_the_shape_and_dtype_asked_and_do_not_overlap(carver):
    buffers = carver.buffers((1, 3, 50, 8), np.dtype(np.float16), mx.float16, 2)
    buffers += carver.buffers((1, 3, 7, 8), np.dtype(np.float16), mx.float16, 2)
    assert [b.shape for b in buffers] == [(1, 3, 50, 8)] * 2 + [(1, 3, 7, 8)] * 2
    assert all(b.dtype == np.float16 and b.flags.writeable and b.flags.c_contiguous
               for b in buffers)
    spans = sorted((_span(b) for b in buffers), key=lambda r: r.start)
    assert all(a.stop <= b.start for a, b in zip(spans, spans[1:], strict=False))
    # One slab: every buffer starts a whole number of pages after the first.
    assert all((s.start - spans[0].start) % 4096 == 0 for s in spans)


def test_mlx_reads_what_was_written_through_the_buffers_without_a_copy(carver):
    first, second = carver.buffers((2, 5), np.dtype(np.float32), mx.float32, 2)
    first[...] = np.arange(10, dtype=np.float32).reshape(2, 5)
    second[...] = -1
    a, b = mlx_view(first), mlx_view(second)
    assert a.shape == (2, 5) and a.dtype == mx.float32
    assert np.array_equal(np.array(a), first) and float(mx.sum(b).item()) == -10.0
    assert np.array(b, copy=False).ctypes.data == second.ctypes.data  # the same memory


def test_a_full_slab_is_replaced_and_large_requests_get_their_own(carver):
    a, b = carver.buffers((1024,), np.dtype(np.uint16), mx.uint16, 2)
    (big,) = carver.buffers((600 * 1024,), np.dtype(np.uint16), mx.uint16, 1)  # 1.2 MiB > slab
    (after,) = carver.buffers((1024,), np.dtype(np.uint16), mx.uint16, 1)
    assert big.shape == (600 * 1024,)
    assert len({_span(x).start for x in (a, b, big, after)}) == 4
    assert after.ctypes.data not in _span(a) and after.ctypes.data not in _span(big)


def test_every_buffer_starts_on_a_cache_line_and_own_buffers_become_their_own_arrays(carver):
    """MLX's allocations start 8 bytes past a cache line; decrypts into them ran ~12% slower
    (mlxcel_plugin/cache_lines.py). Slab views and own allocations alike start on one, and an
    own buffer adopted is still the only array of its allocation: MLX writes into it in
    place (a token past the first 32, as a decode step does into a buffer with room)."""
    small = carver.buffers((3, 100), np.dtype(np.float16), mx.float16, 3)
    (carved,) = carver.buffers((64, 1024), np.dtype(np.float32), mx.float32, 1)
    big = unfilled.own_buffers((2, 600, 1024), np.dtype(np.uint16), mx.uint16, 2,
                               mx.new_stream(mx.cpu))
    assert all(b.ctypes.data % CACHE_LINE_BYTES == 0 for b in [*small, carved, *big])
    big[0][...] = 7
    array = mlx_view(big.pop(0))
    gc.collect()
    address = np.array(array, copy=False).ctypes.data
    array[:, 32:33, :] = mx.ones((2, 1, 1024), dtype=mx.uint16)
    mx.eval(array)
    assert np.array(array, copy=False).ctypes.data == address  # in place: no copy
    assert int(array[0, 32, 0].item()) == 1 and int(array[1, 599, 1023].item()) == 7


def test_a_slab_lives_while_any_view_of_it_does(carver):
    keep, drop = carver.buffers((4096,), np.dtype(np.float32), mx.float32, 2)
    keep[...] = 7
    kept = mlx_view(keep)
    del keep, drop
    carver.buffers((300 * 1024,), np.dtype(np.float32), mx.float32, 1)  # moves to a new slab
    gc.collect()
    assert float(mx.max(kept).item()) == 7.0 and float(mx.min(kept).item()) == 7.0


def test_a_view_for_another_thread_is_evaluated_there_without_a_copy(carver):
    """The decode engine evaluates adopted layers on its own thread, whose stream it passes."""
    (buffer,) = carver.buffers((3, 4), np.dtype(np.float32), mx.float32, 1)
    carver.buffers((3, 4), np.dtype(np.float32), mx.float32, 1)  # so buffer is part of a slab
    buffer[...] = 2
    streams: queue.Queue = queue.Queue()
    views: queue.Queue = queue.Queue()
    seen: list = []

    def engine_thread() -> None:
        streams.put(mx.default_stream(mx.cpu))
        view = views.get(timeout=10)
        seen.append((float(mx.sum(view * 1).item()), np.array(view, copy=False).ctypes.data))

    thread = threading.Thread(target=engine_thread)
    thread.start()
    views.put(mlx_view(buffer, streams.get(timeout=10)))
    thread.join(timeout=10)
    assert seen == [(24.0, buffer.ctypes.data)]


def test_mlx_view_refuses_memory_that_is_not_a_contiguous_view_of_mlx():
    assert mlx_view(np.zeros(4, dtype=np.float32)) is None  # numpy's own memory
    whole = np.array(mx.zeros((2, 8)), copy=False)
    assert mlx_view(whole[:, :3]) is None  # strided: a copy, not a view, is right
    assert mlx_view(whole).shape == (2, 8)


def test_an_mlx_that_cannot_load_from_a_stream_gets_zero_filled_memory(monkeypatch):
    def refuse(*args, **kwargs):
        raise ValueError("[load_npy] Input must be a file-like object, or string")

    monkeypatch.setattr(unfilled.mx, "load", refuse)
    vector = unfilled_vector(16, np.dtype(np.float16), mx.float16, mx.new_stream(mx.cpu))
    assert vector.shape == (16,) and vector.dtype == mx.float16
    assert not np.array(vector).any()


def test_several_vectors_come_from_one_load_or_one_by_one_when_mlx_refuses(monkeypatch):
    stream = mx.new_stream(mx.cpu)
    vectors = unfilled.unfilled_vectors(4096, np.dtype(np.uint16), mx.uint16, 3, stream)
    addresses = {np.array(v, copy=False).ctypes.data for v in vectors}
    assert [v.shape for v in vectors] == [(4096,)] * 3 and len(addresses) == 3
    formats = []
    load = unfilled.mx.load

    def npy_only(stream_or_path, format=None, **kwargs):
        formats.append(format)
        if format == "safetensors":
            raise ValueError("[load_safetensors] this MLX reads no streams")
        return load(stream_or_path, format=format, **kwargs)

    monkeypatch.setattr(unfilled.mx, "load", npy_only)
    vectors = unfilled.unfilled_vectors(16, np.dtype(np.float16), mx.float16, 2, stream)
    assert [(v.shape, v.dtype) for v in vectors] == [((16,), mx.float16)] * 2
    assert formats == ["safetensors", "npy", "npy"]


def test_the_header_only_stream_leaves_the_data_bytes_as_found():
    stream = unfilled._HeaderOnly.npy((4,), np.dtype(np.float32))
    head = bytearray(128)
    assert stream.readinto(head) == 128 and head.startswith(b"\x93NUMPY")
    data = bytearray(b"\xaa" * 16)
    assert stream.readinto(data) == 16 and data == bytearray(b"\xaa" * 16)
    assert stream.readinto(bytearray(8)) == 0  # past the end


def test_shared_slabs_are_not_advised_huge_pages(monkeypatch):
    monkeypatch.setattr(unfilled, "advise_huge_pages", lambda slab: pytest.fail("advised"))
    carver = SlabCarver(mx.new_stream(mx.cpu), slab_bytes=8 << 20)
    carver.buffers((1024,), np.dtype(np.float32), mx.float32, 2)
    carver.prefault(8 << 20)


@pytest.fixture
def fresh_carver(monkeypatch):
    """A carver whose slabs are fresh anonymous mappings: pages never touched, whatever
    memory this process freed before (MLX or malloc may hand back pages already faulted);
    every buffer these tests ask for (1-3 MiB) comes from its slabs."""

    def fresh_vector(size: int, dtype: np.dtype, storage, stream) -> np.ndarray:
        return np.frombuffer(mmap.mmap(-1, size * dtype.itemsize), dtype=dtype)

    monkeypatch.setattr(unfilled, "unfilled_vector", fresh_vector)
    monkeypatch.setattr(unfilled, "OWN_ALLOCATION_BYTES", 64 << 20)
    return lambda slab_bytes: SlabCarver(mx.new_stream(mx.cpu), slab_bytes=slab_bytes)


def minor_faults_writing(buffer: np.ndarray) -> int:
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    buffer.fill(7)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


POPULATE = huge_pages.populate_write(np.empty(4096, np.uint8)) > 0


@pytest.mark.skipif(not POPULATE, reason="no MADV_POPULATE_WRITE (Linux 5.14+) here")
def test_prefault_warms_the_next_views_pages_and_changes_no_byte_written(fresh_carver):
    f32 = np.dtype(np.float32)
    carver = fresh_carver(64 << 20)
    (written,) = carver.buffers((1 << 18,), f32, mx.float32, 1)  # 1 MiB, as a handoff lands
    written[:] = np.arange(written.size, dtype=np.float32)
    step = unfilled.PREFAULT_STEP_BYTES
    assert carver.prefault(step) == step  # one engine iteration's share, no more
    assert carver.prefault(64 << 20) == unfilled.PREFAULT_AHEAD_BYTES - step  # the rest due
    assert carver.prefault(64 << 20) == 0  # nothing is faulted twice
    assert np.array_equal(written, np.arange(written.size, dtype=np.float32))
    (warm,) = carver.buffers((1 << 18,), f32, mx.float32, 1)
    carver.buffers((3 << 18,), f32, mx.float32, 5)  # up to 17 MiB: one past what was due
    (cold,) = carver.buffers((1 << 18,), f32, mx.float32, 1)
    assert minor_faults_writing(warm) <= 8
    assert minor_faults_writing(cold) >= 200  # 256 pages of 4 KiB, fresh


@pytest.mark.skipif(not POPULATE, reason="no MADV_POPULATE_WRITE (Linux 5.14+) here")
def test_the_next_slab_is_allocated_and_warmed_before_the_current_one_runs_out(fresh_carver):
    f32, mib = np.dtype(np.float32), 1 << 18  # elements in 1 MiB
    carver = fresh_carver(40 << 20)
    first = carver.buffers((3 * mib,), f32, mx.float32, 9)  # 13 MiB left: below the 16 ahead
    carver.prefault(64 << 20)  # the current slab's 13 MiB, then the next one's first 3
    first += carver.buffers((3 * mib,), f32, mx.float32, 4)  # 1 MiB left
    later, beyond = carver.buffers((3 * mib,), f32, mx.float32, 2)  # the next slab's first 6
    assert all(_span(later).start >= _span(b).stop or _span(b).start >= _span(later).stop
               for b in first)
    assert minor_faults_writing(later) <= 8  # warmed while the first slab served
    assert minor_faults_writing(beyond) >= 600  # past what was due: cold (768 pages)
