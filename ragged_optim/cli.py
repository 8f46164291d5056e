"""The `ragged-optim` command line: `plan`, `train`, `bench`."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ragged-optim", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    from ragged_optim import plan_cmd

    plan_cmd.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return args.func(args)
