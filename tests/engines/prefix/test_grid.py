"""Where prefills split, what the prefix cache keeps and where a hit resumes (pure arithmetic)."""

from __future__ import annotations

import random

import pytest

from engines.prefix.grid import PrefillGrid

WHOLE = PrefillGrid(256)
ANY = PrefillGrid(256, min_rows=32)


def test_forwards_never_cross_a_cell_and_end_with_the_last_token_alone():
    assert WHOLE.forwards(0, 600) == [(0, 256), (256, 512), (512, 599), (599, 600)]
    assert ANY.forwards(300, 600) == [(300, 512), (512, 599), (599, 600)]
    assert WHOLE.forwards(0, 257) == [(0, 256), (256, 257)]
    assert WHOLE.forwards(0, 1) == [(0, 1)]
    with pytest.raises(ValueError):
        WHOLE.forwards(600, 600)


def test_whole_cells_keep_and_reuse_only_whole_cells():
    assert [WHOLE.exact_end(n) for n in (1, 256, 257, 512, 513, 1100)] == [0, 0, 256, 256, 512,
                                                                           1024]
    assert WHOLE.usable(held=650, total=700) == 512
    assert WHOLE.usable(held=650, total=513) == 512
    assert WHOLE.usable(held=650, total=512) == 256  # its own last cell is partial


def test_any_token_keeps_a_partial_last_cell_with_enough_rows():
    assert ANY.exact_end(1100) == 1099  # 75 rows after the last whole cell
    assert ANY.exact_end(1050) == 1024  # 25 rows: too few to be exact
    assert ANY.exact_end(1057) == 1056


def test_any_token_resumes_anywhere_its_first_forward_has_enough_rows():
    assert ANY.usable(held=1099, total=1200) == 1099  # first forward [1099, 1199): 100 rows
    assert ANY.usable(held=1099, total=1110) == 1077  # 10 rows left: back off to 32 rows
    assert ANY.usable(held=1099, total=1140) == 1099
    assert ANY.usable(held=1260, total=1400) == 1248  # [1260, 1280) too short: back off to 32
    assert ANY.usable(held=1270, total=1271) == 1238  # nothing left but the last token
    assert ANY.usable(held=1030, total=1040) == 1024  # fewer than 32 rows in the cell so far
    assert ANY.usable(held=0, total=10) == 0


def _rows_of_changed_forwards(grid: PrefillGrid, resume: int, total: int) -> list[int]:
    """Rows of each forward of a resumed prefill that a cache-off prefill does not run as is."""
    cold = set(grid.forwards(0, total))
    return [end - begin for begin, end in grid.forwards(resume, total) if (begin, end) not in cold]


def test_a_resumed_prefill_differs_from_a_cold_one_only_in_forwards_of_enough_rows():
    rng = random.Random(5)
    for _ in range(2000):
        grid = rng.choice([WHOLE, ANY, PrefillGrid(128, 8), PrefillGrid(64, 16)])
        stored = rng.randrange(1, 1500)
        total = stored + rng.randrange(-200, 400)
        if total < 2:
            continue
        resume = grid.usable(grid.exact_end(stored), total)
        assert 0 <= resume <= min(grid.exact_end(stored), total - 1)
        rows = _rows_of_changed_forwards(grid, resume, total)
        assert len(rows) <= 1  # only the first forward may differ
        if rows:
            assert grid.any_token and rows[0] >= grid.min_rows
