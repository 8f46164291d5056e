"""Shared pieces of the benchmarks: collective counting that also sees DTensor's functional collectives, timing
with barriers, machine description, result tables."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ragged_optim.comm.counter import CommStats, count_collectives

# torch.ops._c10d_functional ops (what DTensor redistributions issue) -> (kind, how to size them). They bypass the
# torch.distributed functions that count_collectives patches, so they are counted here by the same byte rule:
# the all-gather output, the reduce-scatter / all-to-all / all-reduce / broadcast input.
_FUNCTIONAL = {
    "all_gather_into_tensor": ("all_gather", "gather"),
    "all_gather_into_tensor_out": ("all_gather", "gather"),
    "all_gather_into_tensor_coalesced": ("all_gather", "gather"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_tensor_out": ("reduce_scatter", "input"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "input"),
    "all_to_all_single": ("all_to_all", "input"),
    "all_reduce": ("all_reduce", "input"),
    "all_reduce_": ("all_reduce", "input"),
    "all_reduce_coalesced": ("all_reduce", "input"),
    "all_reduce_coalesced_": ("all_reduce", "input"),
    "broadcast": ("broadcast", "input"),
    "broadcast_": ("broadcast", "input"),
}


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(t) for t in obj)
    return 0


class _FunctionalCollectiveCounter(TorchDispatchMode):
    def __init__(self, stats: CommStats):
        super().__init__()
        self.stats = stats

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is DTensor for t in types):
            return NotImplemented  # let the subclass (DTensor) desugar into collectives on plain tensors first
        if func.namespace == "_c10d_functional":
            entry = _FUNCTIONAL.get(func._opname)
            if entry is not None:
                kind, rule = entry
                nbytes = _tensor_bytes(args[0])
                if rule == "gather":
                    nbytes *= int(args[1])  # group_size
                self.stats.calls[kind] += 1
                self.stats.bytes[kind] += nbytes
        return func(*args, **kwargs)


@contextmanager
def count_all_collectives():
    """``count_collectives`` (every torch.distributed call) plus the functional collectives that DTensor ops issue
    underneath (``torch.ops._c10d_functional``), in one CommStats. Used on both sides of every comparison."""
    with count_collectives() as stats, _FunctionalCollectiveCounter(stats):
        yield stats


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
