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

from ragged_optim.comm.collectives import serves_cuda


def timed(fn: Callable[..., object], *args, group=None) -> float:
    """Wall seconds for every rank of ``group`` to finish ``fn(*args)`` (a barrier on each side)."""
    _sync_device()
    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn(*args)
    _sync_device()
    dist.barrier(group=group)
    return time.perf_counter() - t0


def train_step(model, opt, x, y, opt_times=None) -> None:
    """One training step; ``opt.step()``'s own seconds appended to ``opt_times`` when given."""
    model(x, y).backward()
    t0 = time.perf_counter()
    opt.step()
    if opt_times is not None:
        opt_times.append(time.perf_counter() - t0)
    opt.zero_grad(set_to_none=True)


def alternate_sides(sides: dict, batches) -> dict:
    """Train ``sides`` (``{"ours": (model, opt), "fsdp2": (model, opt)}``) side by side on ``batches``: step k runs
    ours then FSDP2 for even k, FSDP2 then ours for odd k, so drifting machine load hits both alike. Step 0 is a
    warmup, step 1 is counted (``count_collectives``), the rest are timed (a barrier on each side). Returns the
    figures by the keys ``bench fsdp`` and ``bench tp`` share (docs/benchmarks.md)."""
    from ragged_optim.comm.counter import count_collectives

    times, opt_times, counts = {k: [] for k in sides}, {k: [] for k in sides}, {}
    for s, (x, y) in enumerate(batches):
        for name in ["ours", "fsdp2"] if s % 2 == 0 else ["fsdp2", "ours"]:
            model, opt = sides[name]
            if s == 1:
                with count_collectives() as stats:
                    train_step(model, opt, x, y)
                counts[name] = stats
            else:
                t = timed(train_step, model, opt, x, y, opt_times[name] if s >= 2 else None)
                if s >= 2:
                    times[name].append(t)
    out = comm_figures(counts)
    for name in ("ours", "fsdp2"):
        out[f"{name}_step_s"] = median(times[name])
        out[f"{name}_step_times_s"] = times[name]
        out[f"{name}_adamw_step_s"] = median(opt_times[name])
    return out


def comm_figures(counts: dict) -> dict:
    """``{side: CommStats}`` of a counted step as the benchmarks report it: ``<side>_collectives_per_step``,
    ``<side>_bytes_per_step`` and ``<side>_comm`` (calls and bytes per kind)."""
    out = {}
    for side, stats in counts.items():
        out[f"{side}_collectives_per_step"] = stats.total_calls
        out[f"{side}_bytes_per_step"] = stats.total_bytes
        out[f"{side}_comm"] = stats.as_dict()
    return out


def single_replay(model, opt, steps: int, ranks: int, batch: Callable) -> dict:
    """Every step in one process: each of ``ranks`` data-parallel ranks' rows ``batch(step, rank)`` as a
    micro-batch, so the gradient sum has the same terms as the sharded run's; the params after it, by name."""
    for s in range(steps):
        for r in range(ranks):
            x, y = batch(s, r)
            (model(x, y) / ranks).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return dict(model.named_parameters())


def rank_device() -> torch.device:
    """The device a benchmark rank works on: its GPU under NCCL (``run_on_ranks(device="cuda")``), else the CPU."""
    if serves_cuda() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync_device() -> None:
    """Wait for queued GPU work, so a wall time covers the kernels it launched (nothing to do on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def max_over_ranks(x: float, group=None) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


#: CPU flags that decide our kernels' speed on a CPU: AVX2/AVX-512 for fp32 GEMMs, native bf16 (avx512_bf16,
#: AMX) for torch's bf16 matmuls, which Muon's Newton-Schulz and bf16 mixed precision use.
RELEVANT_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_description(cpuinfo: str | None = None) -> dict:
    """The CPU's model name and which of RELEVANT_CPU_FLAGS it has (from /proc/cpuinfo; None where unreadable)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    model, flags = None, None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and flags is None:
            present = set(value.split())
            flags = [f for f in RELEVANT_CPU_FLAGS if f in present]
    return {"cpu_model": model or platform.processor() or None, "cpu_flags": flags}


def machine_info() -> dict:
    """What the figures were measured on: CPU model and flags, ATen's CPU kernel level, Newton-Schulz's matmul
    choice for bf16 on this CPU (``ns_matmul="auto"``), thread and CPU counts, versions, date."""
    from ragged_optim.kernels.newton_schulz import resolve_ns_matmul

    return {
        **cpu_description(),
        "cpu_count": os.cpu_count(),
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_bf16_gemm_native": resolve_ns_matmul("auto", torch.bfloat16, "cpu") == "native",
        "ns_matmul_auto_bf16_cpu": resolve_ns_matmul("auto", torch.bfloat16, "cpu"),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def machine_line(machine: dict) -> str:
    flags = machine.get("cpu_flags")
    flag_text = ", ".join(flags) if flags else "none of " + "/".join(RELEVANT_CPU_FLAGS)
    return (
        f"{machine.get('cpu_model')} ({machine['cpu_count']} CPUs; flags: {flag_text}; ATen "
        f"{machine.get('aten_cpu_capability')}; Muon's bf16 Newton-Schulz ns_matmul=auto -> "
        f"{machine.get('ns_matmul_auto_bf16_cpu')}), torch {machine['torch']}, Python {machine['python']}, "
        f"{machine['platform']}; {machine['date']}"
    )


def seed_stats(values: list[float]) -> dict:
    """Mean of a figure over seeds, with the seed-to-seed spread beside it: sample std, min, max, each value."""
    return {
        "mean": statistics.fmean(values),
        "seed_std": statistics.stdev(values) if len(values) > 1 else None,
        "min": min(values),
        "max": max(values),
        "per_seed": list(values),
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


def markdown_report(results: dict, machine: dict, row_tables: dict[str, str] | None = None) -> str:
    """Markdown of ``bench all``: the machine, then one key/value table per benchmark; a benchmark in
    ``row_tables`` (name -> its own Markdown table of rows) shows that table in place of its ``families`` key."""
    row_tables = row_tables or {}
    out = ["# ragged-optim benchmarks", ""]
    out.append(f"Machine: {machine_line(machine)}.")
    out.append("")
    for name, res in results.items():
        out += [f"## {name}", "", "| key | value |", "|---|---|"]
        out += [
            f"| {k} | {_fmt(v).replace('|', '/')} |"
            for k, v in res.items()
            if not (name in row_tables and k == "families")
        ]
        out.append("")
        if name in row_tables:
            out += [row_tables[name], ""]
    return "\n".join(out)
