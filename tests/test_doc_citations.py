"""Design notes the code and docs cite exist in the repository: ``docs/...``, never ``DESIGN.md``;
every relative link of the Markdown pages leads to a file, and the README links every page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("mlxcel_plugin", "engines", "router_plugin", "loadtests", "examples")
DOC_CITATION = re.compile(r"docs/[\w./-]+\.md")
# DESIGN.md lived outside the repository; a citation of it (or of "DESIGN §n") leads nowhere.
OUTSIDE_CITATION = re.compile(r"\bDESIGN(\.md|\s*§|\s+measurements)")


# A Markdown link's target: ](path) or ](path#anchor); a URL or a bare #anchor is not a file.
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
EXTERNAL = re.compile(r"^([a-z][a-z0-9+.-]*:|#)")


def markdown_pages() -> list[Path]:
    return sorted([REPO / "README.md", REPO / "loadtests" / "README.md",
                   *(REPO / "docs").glob("*.md")])  # fmt: skip


def cited_files() -> list[Path]:
    files = [p for folder in SOURCES for p in (REPO / folder).rglob("*.py")]
    return sorted([*files, *markdown_pages()])


def broken_links(page: Path) -> list[str]:
    targets = MARKDOWN_LINK.findall(page.read_text(encoding="utf-8"))
    files = [t.split("#", 1)[0] for t in targets if not EXTERNAL.match(t)]
    return sorted({f for f in files if not (page.parent / f).exists()})


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("path", cited_files(), ids=_rel)
def test_citations_lead_to_docs_in_the_repo(path: Path):
    text = path.read_text(encoding="utf-8")
    outside = [m.group(0) for m in OUTSIDE_CITATION.finditer(text)]
    assert not outside, f"{_rel(path)} cites notes outside the repo: {outside}; cite docs/"
    missing = sorted({c for c in DOC_CITATION.findall(text) if not (REPO / c).is_file()})
    assert not missing, f"{_rel(path)} cites missing docs: {missing}"


@pytest.mark.parametrize("page", markdown_pages(), ids=_rel)
def test_relative_links_lead_to_files(page: Path):
    broken = broken_links(page)
    assert not broken, f"{_rel(page)} links to missing files: {broken}"


def test_the_readme_links_every_docs_page():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    pages = sorted(_rel(p) for p in (REPO / "docs").glob("*.md"))
    unlinked = [page for page in pages if f"]({page})" not in readme]
    assert not unlinked, f"README.md does not link: {unlinked}"


def test_broken_links_are_found(tmp_path: Path):
    (tmp_path / "there.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text("[a](there.md#top) [b](gone.md) [c](https://x.org/y.md) [d](#here)")
    assert broken_links(page) == ["gone.md"]


def test_the_patterns_catch_what_they_should():
    assert OUTSIDE_CITATION.search("see DESIGN.md §8")
    assert OUTSIDE_CITATION.search("(DESIGN §8)")
    assert not OUTSIDE_CITATION.search("the design notes in docs/design.md")
    assert DOC_CITATION.findall("see docs/protocol.md §3 and docs/design.md.") == [
        "docs/protocol.md",
        "docs/design.md",
    ]
