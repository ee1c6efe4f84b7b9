"""Every relative link in README.md and docs/*.md points to a file that exists and, where it names
an anchor, to a heading of that file (GitHub's anchors: lower case, punctuation dropped, spaces
as hyphens, -1, -2, ... for repeats)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.quick  # no launch: the quick tier (pytest -m quick)

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)
FENCED = re.compile(r"```.*?```", re.DOTALL)  # a heading's inline code is part of its anchor


def anchors(page: Path) -> Iterator[str]:
    """The anchors GitHub gives the headings of a Markdown page."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCED.sub("", page.read_text()), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(CODE.sub("", page.read_text())) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in set(anchors(file)):
            broken.append(f"{target}: no heading with that anchor in {file.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_the_readme_links_every_page():
    """A page nobody can reach from the front door is caught too."""
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md") if t.startswith("docs/")}
    assert set(PAGES[1:]) <= linked, sorted(p.name for p in set(PAGES[1:]) - linked)


def test_the_layout_page_names_every_file():
    """docs/layout.md's "Every file" block names each tracked file (by path, or by name in launch/'s
    entry); tests/, bench/ and docs/ keep their own indexes (tests/README.md, python -m bench, README)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    block = (ROOT / "docs" / "layout.md").read_text().split("## Every file", 1)[1]
    named = set(re.findall(r"[\w./-]+", block))
    unnamed = [f for f in tracked if not f.startswith(("tests/", "bench/", "docs/"))
               and f not in named and not (f.startswith("launch/") and Path(f).name in named)
               and not f.endswith("/__init__.py")]
    assert not unnamed, f"docs/layout.md does not name {unnamed}"
