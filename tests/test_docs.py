"""The README stays a front door and its links lead somewhere: it is at most 300 lines (issue 48), and
every relative link in it and in docs/ names a file that exists and, with a ``#anchor``, a heading
of that file. (tests/e2e/test_readme.py runs the commands these files show.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))]


def anchors(text: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown text (outside code blocks)."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    headings = re.findall(r"^#{1,6} (.+)$", prose, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def relative_links(text: str) -> list[str]:
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    targets = re.findall(r"\]\(([^)\s]+)\)", prose)
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


def test_the_readme_is_at_most_300_lines() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_the_readme_links_every_page_of_docs() -> None:
    linked = {t.split("#")[0] for t in relative_links((ROOT / "README.md").read_text())}
    assert {f"docs/{p.name}" for p in PAGES[1:]} <= linked


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in PAGES:
        text = page.read_text()
        for target in relative_links(text):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and anchor not in anchors(dest.read_text()):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken
