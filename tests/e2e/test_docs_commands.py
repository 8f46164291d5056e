"""Commands quoted in docs/*.md and notebooks/README.md run from a fresh shell after `./dev` built `.venv` (issue
35): `./dev bench ...`, `./dev python ...`, `./dev pip ...` or `.venv/bin/...`, not a bare `ragged-optim ...`,
`python ...` or `pip install ...` that only an activated venv finds. Names alone (`ragged-optim plan`, `python -m`)
and error messages (`ragged-optim plan: error: ...`) are not commands."""

from __future__ import annotations

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# a command needing an activated venv: the CLI with a subcommand and an argument, a script or -c, a pip install
BARE = re.compile(r"^(ragged-optim (bench|train|plan) (?!.*: error)|python (-c \S|-m \S|\S+\.py)|pip install )")


def _inline_code(text: str) -> list[str]:
    prose = re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.S | re.M)  # fenced blocks: tests/e2e/test_readme.py
    return [m.group(1).replace("\n", " ") for m in re.finditer(r"`([^`]+)`", prose)]


def bare_commands(text: str) -> list[str]:
    return [c for c in _inline_code(text) if BARE.match(c)]


def test_doc_commands_need_no_activated_venv():
    found = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "notebooks", "README.md")]:
        with open(path) as f:
            bad = bare_commands(f.read())
        if bad:
            found[os.path.relpath(path, ROOT)] = bad
    assert not found, f"spell these ./dev ... or .venv/bin/... (as README.md does): {found}"


def test_the_check_finds_a_bare_command():
    text = "Run `ragged-optim bench soap --json`, or `python benchmarks/x.py`.\n```bash\nignored\n```\n`./dev train`"
    assert bare_commands(text) == ["ragged-optim bench soap --json", "python benchmarks/x.py"]
    assert bare_commands("`ragged-optim plan: error: --module x`, `python -m` and `ragged-optim train`") == []
