"""The README's code blocks, as tests read them (tests/e2e/test_readme.py, tests/e2e/test_examples.py).

A ``python`` block is either a complete script whose first line says how to run it, ``# NAME.py: run with  CMD``,
or an excerpt: the paragraph before it says ``Excerpt of [`PATH`](PATH)``, and every line of it is in that file.
A ``bash`` block holds commands, one a line (``a && b`` is two; ``# ...`` is a comment)."""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
DEV = os.path.join(ROOT, "dev")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_HEADER = re.compile(r"^# (\S+\.py): run with  (.+)$")
_EXCERPT = re.compile(r"Excerpt of \[`([^`]+)`\]\(([^)]+)\)")


@dataclass
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    before: str  # the paragraph just above the block

    @property
    def where(self) -> str:
        return f"README.md:{self.line}"

    def script(self) -> tuple[str, str] | None:
        """(file name, command) from a python block's first line, or None."""
        m = _HEADER.match(self.code.split("\n", 1)[0])
        return (m.group(1), m.group(2)) if m else None

    def excerpt_of(self) -> str | None:
        """The path an excerpt links to, or None."""
        m = _EXCERPT.search(self.before)
        return m.group(2) if m else None

    def commands(self) -> list[list[str]]:
        """A bash block's commands, each as argv."""
        out = []
        for line in self.code.splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                out.append(words[:cut])
                words = words[cut + 1 :]
        return out


def blocks(path: str = README) -> list[Block]:
    text = open(path, encoding="utf-8").read()
    out = []
    for m in _FENCE.finditer(text):
        head = text[: m.start()]
        paragraphs = head.rstrip("\n").rsplit("\n\n", 1)
        out.append(Block(m.group(1), m.group(2), head.count("\n") + 1, paragraphs[-1]))
    return out


def commands(prefix: list[str]) -> list[list[str]]:
    """Every README command that starts with ``prefix`` (argv words), in order."""
    return [c for b in blocks() if b.lang == "bash" for c in b.commands() if c[: len(prefix)] == prefix]


def _example(path, name):
    """The class ``name`` from the first python block of ``path`` (from the repo root) that defines it, executed as
    written (the block-API and tile tests run the README's and docs/custom_optimizer.md's examples)."""
    from pathlib import Path

    import torch

    import ragged_optim as ro

    text = (Path(ROOT) / path).read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)```", text, re.S) if f"class {name}(" in c)
    namespace: dict = {"torch": torch, "ro": ro}  # the README's snippets assume these imports
    exec(compile(code, path, "exec"), namespace)
    return namespace[name]
