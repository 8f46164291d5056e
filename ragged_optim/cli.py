"""The `ragged-optim` command line: `train` (the main job), `plan`, `bench`."""

from __future__ import annotations

import argparse
import sys

# Each module exposes add_parser(subparsers), which registers one subcommand and sets its `func`.
_COMMAND_MODULES = ("ragged_optim.train", "ragged_optim.plan_cmd", "ragged_optim.bench")


def build_parser() -> argparse.ArgumentParser:
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return args.func(args)
