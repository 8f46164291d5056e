"""Every key a benchmark returns is documented in docs/benchmarks.md, "JSON keys of each benchmark" (issue 35:
`bench muon --json` printed `max_rel_diff_vs_unsharded_bfloat16` with nothing saying what it was). The smoke tests
that run each benchmark call :func:`assert_keys_documented` on what it returned."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs", "benchmarks.md")
SECTION = "## JSON keys of each benchmark"


def documented_keys(name: str) -> list[re.Pattern]:
    """The keys in the first column of the table under ``### `bench NAME` `` (``<x>``: any word)."""
    text = open(DOCS, encoding="utf-8").read()
    assert SECTION in text, f"docs/benchmarks.md has no {SECTION!r} section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    parts = re.split(r"^### `bench (\w+)`\n", section, flags=re.M)
    tables = dict(zip(parts[1::2], parts[2::2]))
    assert name in tables, f"docs/benchmarks.md, {SECTION}: no ### `bench {name}` subsection"
    keys = []
    for row in tables[name].splitlines():
        cells = row.split("|")
        if row.startswith("|") and len(cells) > 2:
            for key in re.findall(r"`([^`]+)`", cells[1]):
                keys.append(re.compile(re.sub(r"<\w+>", "[a-z0-9_]+", re.escape(key)) + "$"))
    return keys


def undocumented(name: str, result: dict) -> list[str]:
    keys = documented_keys(name)
    return sorted(k for k in result if not any(p.match(k) for p in keys))


def assert_keys_documented(name: str, result: dict) -> None:
    missing = undocumented(name, result)
    assert not missing, f"bench {name} returns keys docs/benchmarks.md ({SECTION}) does not explain: {missing}"
