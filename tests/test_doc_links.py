"""Every relative link in README.md and docs/ names a file of the repository, and every page in
docs/ is reachable from the README (issue 32: the README maps docs/)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def _links(page: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(page.read_text()) if "://" not in m.group(1)]


def test_relative_links_name_files_that_exist():
    broken = [
        f"{page.relative_to(ROOT)} -> {target}"
        for page in PAGES
        for target in _links(page)
        if not (page.parent / target).exists()
    ]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / target).resolve() for target in _links(ROOT / "README.md")}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"docs/ pages the README does not link: {missing}"
