"""freeze_startup_heap: start-up objects leave the collector's scans; garbage does not stay."""

from __future__ import annotations

import gc
import weakref

import pytest

from mlxcel_plugin.gc_pauses import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture
def thawed():
    frozen_by_the_suite = gc.get_freeze_count()  # tests/conftest.py, after collection
    yield
    gc.unfreeze()  # the rest of the suite runs with the collector as it found it
    if frozen_by_the_suite:
        freeze_startup_heap()


def test_live_objects_are_frozen_and_cyclic_garbage_is_freed_first(thawed):
    live = [_Node() for _ in range(100)]
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle only the collector can free
    gone = weakref.ref(a)
    del a, b
    frozen = freeze_startup_heap()
    assert gone() is None  # collected before the freeze, so not kept forever
    # The count it returns is the freeze's; frozen objects that another thread of this worker
    # frees meanwhile leave the permanent generation (a suite run read 990,734 against the
    # 990,738 returned), so the count can only have fallen since.
    assert frozen >= gc.get_freeze_count() >= len(live)
    assert not any(o is live[0] for o in gc.get_objects())  # outside every generation now


def test_objects_made_after_the_freeze_are_still_collected(thawed):
    freeze_startup_heap()
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None
