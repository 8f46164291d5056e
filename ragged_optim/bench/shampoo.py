"""Benchmark: distributed Shampoo on RaggedShard vs a replicated Shampoo, in the same run on W local gloo ranks.

- ours: ``ragged_optim.fully_shard`` + ``Shampoo``; each rank computes only the bands it holds (split bands on
  their owner, one all_to_all each way), and keeps only those bands' factor and root matrices.
- replicated: what a Shampoo that does not know about the sharding must do: every rank all-gathers the full
  gradients and computes every block of every matrix (the same ``Shampoo`` on plain full tensors).

Both optimizers see the same gradients each step. The replicated run is a one-process Shampoo (each rank runs it
whole), so it is also the reference for ``max_rel_diff_vs_unsharded``. Timings are per rank, averaged over the
steps after the first (which allocates state); a step takes as long as its slowest rank, so the max over ranks is
reported. Bytes are counted with :func:`ragged_optim.comm.counter.count_collectives` around each step.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from ragged_optim.comm.counter import count_collectives
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.optim.shampoo import Shampoo
from ragged_optim.sharding import full_grad, full_tensor, fully_shard, shard_info
from ragged_optim.testing import set_full_grad
from ragged_optim.train.accounting import optimizer_state_bytes

#: 10 matrices 256..768 wide, several not multiples of 256 (partial bands and tiles).
DEFAULT_SHAPES = (
    (256, 256),
    (256, 512),
    (512, 256),
    (512, 512),
    (256, 768),
    (768, 256),
    (384, 640),
    (640, 384),
    (320, 512),
    (512, 320),
)


class _Mats(nn.Module):
    def __init__(self, shapes, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(*s, generator=g) * 0.02) for s in shapes])


def _grads(shapes, step, seed):
    g = torch.Generator().manual_seed(seed * 7919 + step)
    return [torch.randn(*s, generator=g) for s in shapes]


def _band_rank(rank, world_size, opt_cls, shapes, B, steps, seed, opt_kw):
    """One rank of a band-preconditioner benchmark (``opt_cls``: Shampoo or SOAP): ours on RaggedShard against the
    same optimizer replicated on gathered full gradients; the first step is not timed."""
    model = _Mats(shapes, seed)
    replicated = [nn.Parameter(p.detach().clone()) for p in model.ws]
    fully_shard(model)
    ours = opt_cls(list(model.ws), max_preconditioner_dim=B, **opt_kw)
    rep = opt_cls(replicated, max_preconditioner_dim=B, **opt_kw)
    t_ours, t_rep, bytes_ours, bytes_rep, calls_ours = [], [], [], [], []
    for step in range(steps):
        for p, g in zip(model.ws, _grads(shapes, step, seed)):
            set_full_grad(p, g)
        dist.barrier()
        t0 = time.perf_counter()
        with count_collectives() as stats:
            ours.step()
        t_ours.append(time.perf_counter() - t0)
        bytes_ours.append(stats.total_bytes)
        calls_ours.append(sum(stats.calls.values()))
        dist.barrier()
        t0 = time.perf_counter()
        with count_collectives() as stats:
            for p, q in zip(model.ws, replicated):
                q.grad = full_grad(p)  # every rank gathers every full gradient
            rep.step()
        t_rep.append(time.perf_counter() - t0)
        bytes_rep.append(stats.total_bytes)
    full = [full_tensor(p).clone() for p in model.ws]
    diff = max(
        ((a - b.detach()).abs().max() / b.detach().abs().max().clamp(min=1e-30)).item()
        for a, b in zip(full, replicated)
    )
    return {
        "ours_s": statistics.mean(t_ours[1:]),
        "rep_s": statistics.mean(t_rep[1:]),
        "ours_bytes": statistics.mean(bytes_ours[1:]),
        "ours_calls": statistics.mean(calls_ours[1:]),
        "rep_bytes": statistics.mean(bytes_rep[1:]),
        "precond_bytes": ours.preconditioner_bytes(),
        "state_bytes": optimizer_state_bytes(ours),
        "rep_precond_bytes": rep.preconditioner_bytes(),
        "diff": diff,
        "cut_bands": sum(
            ob.split for p in model.ws for ob in shard_info(p).unit.layout.owned_blocks[shard_info(p).index]
        ),
    }


def run_band_bench(opt_cls, world_size, steps, shapes, max_preconditioner_dim, seed, timeout_s, opt_kw) -> dict:
    """The figures of ``bench shampoo`` and ``bench soap`` for ``opt_cls`` (max over ranks where ranks differ);
    the cut-band count is ``cut_bands``."""
    if steps < 2:
        raise ValueError(f"steps must be >= 2 (the first step is not timed), got {steps}")
    shapes = [tuple(s) for s in shapes]
    res = run_on_ranks(
        _band_rank, world_size, opt_cls, shapes, max_preconditioner_dim, steps, seed, opt_kw, timeout_s=timeout_s
    )
    ours_s = max(r["ours_s"] for r in res)
    rep_s = max(r["rep_s"] for r in res)
    pre = [r["precond_bytes"] for r in res]
    state = [r["state_bytes"] for r in res]
    return {
        "world_size": world_size,
        "steps": steps,
        "shapes": [list(s) for s in shapes],
        "max_preconditioner_dim": max_preconditioner_dim,
        "ours_opt_step_s": ours_s,
        "replicated_opt_step_s": rep_s,
        "speedup": rep_s / ours_s if ours_s > 0 else float("inf"),
        "precond_bytes_per_rank": pre,
        "precond_bytes_max_over_mean": max(pre) / statistics.mean(pre) if sum(pre) else 1.0,
        "replicated_precond_bytes_per_rank": res[0]["rep_precond_bytes"],
        "state_bytes_per_rank": state,
        "state_bytes_max_over_mean": max(state) / statistics.mean(state) if sum(state) else 1.0,
        "ours_bytes_per_step": max(r["ours_bytes"] for r in res),
        "ours_collectives_per_step": max(r["ours_calls"] for r in res),
        "replicated_bytes_per_step": max(r["rep_bytes"] for r in res),
        "cut_bands": res[0]["cut_bands"],
        "max_rel_diff_vs_unsharded": max(r["diff"] for r in res),
    }


def run(
    world_size: int = 4,
    steps: int = 3,
    json: bool = True,
    *,
    shapes=DEFAULT_SHAPES,
    max_preconditioner_dim: int = 256,
    seed: int = 0,
    timeout_s: float = 600.0,
    **opt_kw,
) -> dict:
    """Run the benchmark on ``world_size`` gloo ranks for ``steps`` steps; returns a JSON-serialisable dict:

    ``ours_opt_step_s`` / ``replicated_opt_step_s`` (mean seconds per step after the first, max over ranks),
    ``speedup`` (replicated / ours), ``precond_bytes_max_over_mean`` (factor + root bytes per rank),
    ``state_bytes_max_over_mean`` (all optimizer state bytes per rank, as ``train``'s summary counts them),
    ``ours_bytes_per_step`` / ``replicated_bytes_per_step`` (collective bytes per rank per step, max over ranks),
    ``ours_collectives_per_step``, ``split_bands`` (bands a rank boundary cuts), ``max_rel_diff_vs_unsharded`` (ours
    vs the one-process run, max over params of max|diff| / max|ref|). ``json`` is accepted for the CLI's sake; the
    result is always a plain dict."""
    out = run_band_bench(Shampoo, world_size, steps, shapes, max_preconditioner_dim, seed, timeout_s, opt_kw)
    out["split_bands"] = out.pop("cut_bands")  # this benchmark's name for them (docs, tests)
    return out


if __name__ == "__main__":
    import json as _json
    import sys

    print(_json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else 4), indent=1))
