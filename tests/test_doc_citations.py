"""Every section the code and docs cite by name exists where they say it is (issue 61).

A citation is a document followed by a quoted section title: `BENCHMARKS.md, "Threads"`,
`dev/LOG.md, 2026-12-01, "What the explanation language cannot say"`, `docs/index.md ("CPU kernels")`.
The title must be (part of) a heading of that document, so a section that moved or was renamed
is caught, not left to point nowhere (report.md printed one such pointer to every user).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("nla", "docs", "dev", "bench", "configs", "tests") for p in (ROOT / d).rglob("*")
           if p.suffix in (".py", ".md", ".yaml", ".sh") and p.name != Path(__file__).name] + \
    [ROOT / "README.md", ROOT / "BENCHMARKS.md"]
CITATION = re.compile(r'(?<![\w/])((?:bench/)?BENCHMARKS|dev/LOG|README|docs/[\w-]+)(?:\.md)?\)?\s*'
                      r'(?:[,:]\s*|\(\s*|\s)(?:\d{4}-\d{2}-\d{2},?\s*)?"([^"]{3,120})"')


def normalise(text: str, python: bool) -> str:
    if python:  # a title split over adjacent string literals ("The warm-start is a " "per-kind lottery") or comment lines
        text = re.sub(r"([\"'])\s*\n\s*[rf]?\1", "", text)
        text = re.sub(r"\n\s*#\s*", " ", text)
    return re.sub(r"\s+", " ", text.replace('\\"', '"'))


def citations(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2).strip().rstrip(",.;")) for m in CITATION.finditer(text)]


def headings(doc: Path) -> list[str]:
    return [re.sub(r"^#+\s*", "", line).replace("`", "").strip().lower()
            for line in doc.read_text(encoding="utf-8").splitlines() if line.startswith("#")]


def test_citations_are_found_in_the_forms_the_tree_uses():
    text = normalise('see BENCHMARKS.md, "Threads"; (dev/LOG.md, 2026-12-01, "What it cannot\n say"); '
                     'x = ("BENCHMARKS.md, \\"The warm-start is a "\n     "per-kind lottery\\")"; '
                     'docs/index.md ("CPU kernels"); bench/BENCHMARKS: "Old"', python=True)
    assert citations(text) == [("BENCHMARKS", "Threads"), ("dev/LOG", "What it cannot say"),
                               ("BENCHMARKS", "The warm-start is a per-kind lottery"), ("docs/index", "CPU kernels"),
                               ("bench/BENCHMARKS", "Old")]


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_section_exists(source):
    missing = []
    for doc, title in citations(normalise(source.read_text(encoding="utf-8", errors="replace"),
                                          source.suffix == ".py")):
        path = ROOT / f"{doc}.md"
        wanted = title.replace("`", "").lower()
        if not path.is_file() or not any(wanted in h for h in headings(path)):
            missing.append(f'{doc}.md "{title}"')
    assert not missing, f"{source.relative_to(ROOT)} cites sections that do not exist: {missing}"
