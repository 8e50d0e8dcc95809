"""The README's table of environment variables names every variable the code reads, and
only those: each ``CACHEBUILD_*`` name in the package's source is a row, and every row's
variable occurs in the source."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("cachebuild", "backends", "store", "passes")


def _source_text() -> str:
    return "\n".join(p.read_text() for folder in SOURCES for p in (ROOT / folder).rglob("*.py"))


def _table() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Environment variables"):]
    section = section[:section.index("\n\n", section.index("| variable |"))]
    return re.findall(r"^\| `([A-Z_]+)` \|", section, flags=re.M)


def test_every_variable_the_code_reads_is_in_the_readme_table_and_no_other():
    rows = _table()
    assert len(rows) == len(set(rows)), rows
    source = _source_text()
    # read by name: a quoted string (a constant such as allowed.CACHEBUILD_OPS is no variable)
    in_code = set(re.findall(r"[\"'](CACHEBUILD_[A-Z_]*[A-Z])[\"']", source))
    assert in_code == {r for r in rows if r.startswith("CACHEBUILD_")}
    for name in rows:  # the others (XDG_CACHE_HOME, CXX) are read by name too
        assert re.search(rf"[\"']{name}[\"']", source), f"{name} is in the table, not the code"
