"""Shared pieces of the benchmarks: timing with barriers, machine description, result tables.
Collectives are counted with ``ragged_optim.comm.counter.count_collectives`` (which sees DTensor's too)."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def timed(fn: Callable[..., object], *args, group=None) -> float:
    """Wall seconds for every rank of ``group`` to finish ``fn(*args)`` (a barrier on each side)."""
    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn(*args)
    dist.barrier(group=group)
    return time.perf_counter() - t0


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def max_over_ranks(x: float, group=None) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def machine_info() -> dict:
    return {
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items())
    return str(v)


def format_table(result: dict, title: str | None = None) -> str:
    """A plain two-column table of one benchmark's result dict."""
    rows = [(str(k), _fmt(v)) for k, v in result.items()]
    w = max((len(k) for k, _ in rows), default=3)
    lines = [title, "-" * len(title)] if title else []
    lines += [f"{k.ljust(w)}  {v}" for k, v in rows]
    return "\n".join(lines)


def markdown_report(results: dict, machine: dict) -> str:
    """Markdown of ``bench all``: the machine, then one key/value table per benchmark."""
    out = ["# ragged-optim benchmarks", ""]
    out.append(
        f"Machine: {machine['cpu_count']} CPUs, torch {machine['torch']}, Python {machine['python']}, "
        f"{machine['platform']}; {machine['date']}."
    )
    out.append("")
    for name, res in results.items():
        out += [f"## {name}", "", "| key | value |", "|---|---|"]
        out += [f"| {k} | {_fmt(v).replace('|', '/')} |" for k, v in res.items()]
        out.append("")
    return "\n".join(out)
