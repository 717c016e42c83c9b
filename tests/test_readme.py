"""The README front door and the docs/ pages stay true to the code: the options table lists exactly the
``--perf-*`` flags kimi_perf/options.py declares, and every relative link (file and #anchor) in README.md
and docs/*.md resolves. Issue 27 moved most of the README into docs/ pages; a renamed heading or page
would otherwise leave links that lead nowhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _anchor(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_options_table_matches_the_parser():
    declared = set(re.findall(r'addoption\("(--perf-[a-z-]+)"', (ROOT / "kimi_perf" / "options.py").read_text()))
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| flag | meaning |"):]
    table = table[: table.index("\n\n")]
    listed = set(re.findall(r"`(--perf-[a-z-]+)", table))
    assert declared, "no --perf-* options found in kimi_perf/options.py"
    assert listed == declared, (f"README options table: missing {sorted(declared - listed)}, "
                                f"not an option {sorted(listed - declared)}")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, "broken links:\n  " + "\n  ".join(broken)


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines; the detail belongs in a docs/ page"
