"""Design notes the code cites exist in the repository: ``docs/...``, never ``DESIGN.md``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("mlxcel_plugin", "engines", "router_plugin", "loadtests", "examples")
DOC_CITATION = re.compile(r"docs/[\w./-]+\.md")
# DESIGN.md lived outside the repository; a citation of it (or of "DESIGN §n") leads nowhere.
OUTSIDE_CITATION = re.compile(r"\bDESIGN(\.md|\s*§|\s+measurements)")


def cited_files() -> list[Path]:
    files = [p for folder in SOURCES for p in (REPO / folder).rglob("*.py")]
    return sorted([*files, REPO / "README.md"])


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("path", cited_files(), ids=_rel)
def test_citations_lead_to_docs_in_the_repo(path: Path):
    text = path.read_text(encoding="utf-8")
    outside = [m.group(0) for m in OUTSIDE_CITATION.finditer(text)]
    assert not outside, f"{_rel(path)} cites notes outside the repo: {outside}; cite docs/"
    missing = sorted({c for c in DOC_CITATION.findall(text) if not (REPO / c).is_file()})
    assert not missing, f"{_rel(path)} cites missing docs: {missing}"


def test_the_patterns_catch_what_they_should():
    assert OUTSIDE_CITATION.search("see DESIGN.md §8")
    assert OUTSIDE_CITATION.search("(DESIGN §8)")
    assert not OUTSIDE_CITATION.search("the design notes in docs/design.md")
    assert DOC_CITATION.findall("see docs/protocol.md §3 and docs/design.md.") == [
        "docs/protocol.md",
        "docs/design.md",
    ]
