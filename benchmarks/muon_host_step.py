"""The host's cost of a Muon step: ro.Muon vs torch.optim.Muon + torch.optim.AdamW where the matmuls cost nothing.

On a GPU the `small` GPT's Muon step is bound by the host's cost per op (each op is one kernel launch), not by
the matmuls. This CPU stand-in keeps that regime: the `small` GPT's layout (6 layers, the same params and the
same Muon / AdamW split) at d_model 16, so that the matrices are 16 x 16 .. 64 x 16 and a step is mostly
per-op overhead. Both sides get the same fixed gradients; ro.Muon runs with ``ns_matmul="native"`` (torch's own
Newton-Schulz ops), the default non-finite check on, and ``foreach=True`` (a GPU's default; a CPU's is per
param). The two alternate step by step (the order swapped every step), one thread; the figure is the median over
steps of the paired ratio ours / torch, so that drifting machine load cancels.

    python benchmarks/muon_host_step.py [--steps 150] [--d-model 16]

Prints one JSON line: both medians in ms and ``paired_ratio_ours_over_torch``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from ragged_optim.bench import peers
from ragged_optim.models import GPT, get_config

ROWS = ("ro.Muon native NS", "torch.optim.Muon+AdamW")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--d-model", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = GPT(get_config(peers.PRESET, d_model=args.d_model))
    grads = [torch.randn_like(p) * 1e-2 for p in base.parameters()]
    live = {}
    for row in ROWS:
        model = copy.deepcopy(base)
        opt = peers._make(row, model)
        if row.startswith("ro.Muon"):
            opt.foreach = True  # the GPU's path (foreach on devices with foreach kernels), whose host cost this mimics
        live[row] = (model, opt)
    times: dict[str, list[float]] = {row: [] for row in ROWS}
    for s in range(args.steps + 5):
        for row in ROWS if s % 2 == 0 else ROWS[::-1]:
            model, opt = live[row]
            for p, g in zip(model.parameters(), grads):
                p.grad = g
            t0 = time.perf_counter()
            opt.step()
            if s >= 5:  # the first steps create state
                times[row].append(time.perf_counter() - t0)
    ours, theirs = (times[row] for row in ROWS)
    print(
        json.dumps(
            {
                "d_model": args.d_model,
                "steps": args.steps,
                "ours_ms_median": round(statistics.median(ours) * 1e3, 3),
                "torch_ms_median": round(statistics.median(theirs) * 1e3, 3),
                "paired_ratio_ours_over_torch": round(statistics.median(a / b for a, b in zip(ours, theirs)), 4),
            }
        )
    )


if __name__ == "__main__":
    main()
