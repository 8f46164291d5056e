"""Benchmarks against the peer in the same run: ``ragged-optim bench NAME``.

Each benchmark is a module ``ragged_optim.bench.<name>`` exposing ``run(world_size=..., **kw) -> dict`` (and
optionally ``DESCRIPTION``); the CLI discovers which of :data:`BENCHMARKS` are present.
"""

from ragged_optim.bench.cli import BENCHMARKS, add_parser, available, run_benchmark

__all__ = ["BENCHMARKS", "add_parser", "available", "run_benchmark"]
