"""The `ragged-optim` command line: `train` (the main job), `plan`, `bench`.

Building the parser imports no torch (every ``--help`` answers at once): each command module imports what runs the
command only when it runs; ``tests/cli/test_cli_help.py`` checks it."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys

# Each module exposes add_parser(subparsers), which registers one subcommand and sets its `func`.
_COMMAND_MODULES = ("ragged_optim.train", "ragged_optim.plan_cmd", "ragged_optim.bench")


class UsageError(ValueError):
    """Bad command-line input found after parsing (a value out of range, options that do not fit together).

    ``main`` turns it into an argparse error of the subcommand: usage, ``ragged-optim CMD: error: ...``, exit 2,
    no traceback. A ValueError, so API callers (``TrainConfig.validate``) can catch it as before."""


def module_doc(name: str) -> str:
    """The docstring of module ``name``, read from its source without importing it (help texts, which must not
    import torch)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin:
        raise ModuleNotFoundError(f"no module named {name!r}", name=name)
    with open(spec.origin, encoding="utf-8") as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


def _build() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    import importlib

    parser = argparse.ArgumentParser(prog="ragged-optim", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        if hasattr(module, "add_parser"):  # a package still being written has none yet
            module.add_parser(subparsers)
    return parser, subparsers


def build_parser() -> argparse.ArgumentParser:
    return _build()[0]


def main(argv: list[str] | None = None) -> int:
    parser, subparsers = _build()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except UsageError as e:
        subparsers.choices[args.command].error(str(e))  # exits 2
        raise  # unreachable: error() raises SystemExit
