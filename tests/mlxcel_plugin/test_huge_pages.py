"""Huge pages under receive buffers: the aligned part of a buffer is advised, nothing else."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from mlxcel_plugin import huge_pages

LINUX = sys.platform.startswith("linux")
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_only_whole_aligned_huge_pages_inside_the_buffer_are_advised(monkeypatch):
    calls = []
    monkeypatch.setattr(huge_pages, "_madvise", lambda: lambda at, size, advice: calls.append(
        (at.value, size.value, advice)) or 0)
    buffer = np.empty(5 * huge_pages.HUGE_PAGE_BYTES, dtype=np.uint8)
    advised = huge_pages.advise_huge_pages(buffer)
    ((at, size, advice),) = calls
    assert advice == huge_pages.MADV_HUGEPAGE
    assert at % huge_pages.HUGE_PAGE_BYTES == 0 and size == advised
    assert buffer.ctypes.data <= at and at + size <= buffer.ctypes.data + buffer.nbytes
    assert size >= 4 * huge_pages.HUGE_PAGE_BYTES  # at most one huge page lost to alignment


def test_small_buffers_and_the_off_switch_advise_nothing(monkeypatch):
    monkeypatch.setattr(huge_pages, "_madvise", lambda: pytest.fail("madvise called"))
    monkeypatch.setenv(huge_pages.DISABLE_VAR, "0")
    assert huge_pages.advise_huge_pages(np.empty(8 << 20, dtype=np.uint8)) == 0
    monkeypatch.delenv(huge_pages.DISABLE_VAR)
    monkeypatch.setattr(huge_pages, "_madvise", lambda: lambda *args: pytest.fail("too small"))
    assert huge_pages.advise_huge_pages(np.empty(1 << 20, dtype=np.uint8)) == 0


@pytest.mark.skipif(not LINUX or not THP_MODE.exists()
                    or "[never]" in THP_MODE.read_text(), reason="no transparent huge pages")
def test_advised_memory_faults_in_huge_pages():
    import resource

    buffer = np.empty(64 << 20, dtype=np.uint8)  # fresh mmap memory, untouched
    assert huge_pages.advise_huge_pages(buffer) > 0
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer.fill(1)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    # 4 KiB pages would be 16,384 faults; huge pages (where the kernel has them) far fewer.
    assert faults < 8192, faults


def test_populate_stops_asking_only_a_kernel_without_it(monkeypatch):
    import errno

    answers = [errno.EINTR, 0, errno.EINVAL]
    calls = []
    monkeypatch.setattr(huge_pages, "_populate_works", [True])
    monkeypatch.setattr(huge_pages, "_advise",
                        lambda *args: calls.append(args[2]) or answers[len(calls) - 1])
    buffer = np.empty(4 * huge_pages.PAGE_BYTES, dtype=np.uint8)
    assert huge_pages.populate_write(buffer) == 0  # interrupted: asked again next time
    assert huge_pages.populate_write(buffer) == buffer.nbytes
    assert huge_pages.populate_write(buffer) == 0  # EINVAL: no MADV_POPULATE_WRITE here
    assert huge_pages.populate_write(buffer) == 0
    assert calls == [huge_pages.MADV_POPULATE_WRITE] * 3
