"""Benchmark: SOAP on RaggedShard vs a replicated SOAP, in the same run on W local gloo ranks.

- ours: ``ragged_optim.fully_shard`` + ``SOAP``; each rank computes only the bands it holds (cut bands on their
  owner, one all_to_all each way per step), and keeps only those bands' factors, eigenbases and moments.
- replicated: what a single-device SOAP on FSDP2 does with gathered gradients: every rank all-gathers the full
  gradients and computes every band of every matrix (the same ``SOAP`` on plain full tensors).

Both see the same gradients each step. The replicated run is a one-process SOAP (each rank runs it whole), so it is
also the reference for ``max_rel_diff_vs_unsharded``. The first step (statistics and ``eigh`` only) is not timed;
``precondition_frequency=2`` puts a QR basis refresh in every other timed step (the default, 10, would put none in
a short run). Timings are per rank, averaged over the timed steps; a step takes as long as its slowest rank, so the
max over ranks is reported. Bytes are counted with :func:`ragged_optim.comm.counter.count_collectives`.
"""

from __future__ import annotations

import statistics
import time

import torch.distributed as dist
from torch import nn

from ragged_optim.bench.shampoo import _grads, _Mats
from ragged_optim.comm.counter import count_collectives
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.optim.soap import SOAP
from ragged_optim.sharding import full_grad, full_tensor, fully_shard, shard_info

#: 10 matrices of 256..1024 rows and 128..256 columns (several not multiples of 256: partial bands), so that with
#: B = 256 every band has both a left and a right factor.
DEFAULT_SHAPES = (
    (256, 256),
    (512, 256),
    (768, 256),
    (1024, 128),
    (384, 192),
    (640, 160),
    (320, 256),
    (896, 224),
    (512, 128),
    (1024, 256),
)


def _rank(rank, world_size, shapes, B, steps, seed, opt_kw):
    model = _Mats(shapes, seed)
    replicated = [nn.Parameter(p.detach().clone()) for p in model.ws]
    fully_shard(model)
    ours = SOAP(list(model.ws), max_preconditioner_dim=B, **opt_kw)
    rep = SOAP(replicated, max_preconditioner_dim=B, **opt_kw)
    t_ours, t_rep, bytes_ours, bytes_rep, calls_ours = [], [], [], [], []
    for step in range(steps):
        for p, g in zip(model.ws, _grads(shapes, step, seed)):
            lo, hi = shard_info(p).local_range
            p.grad = g.reshape(-1)[lo:hi].clone()
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
        "rep_precond_bytes": rep.preconditioner_bytes(),
        "diff": diff,
        "cut_bands": sum(
            ob.split for p in model.ws for ob in shard_info(p).unit.layout.owned_blocks[shard_info(p).index]
        ),
    }


def run(
    world_size: int = 4,
    steps: int = 5,
    json: bool = True,
    *,
    shapes=DEFAULT_SHAPES,
    max_preconditioner_dim: int = 256,
    seed: int = 0,
    timeout_s: float = 600.0,
    **opt_kw,
) -> dict:
    """Run the benchmark on ``world_size`` gloo ranks for ``steps`` steps (the first is not timed); returns a
    JSON-serialisable dict:

    ``ours_opt_step_s`` / ``replicated_opt_step_s`` (mean seconds per timed step, max over ranks), ``speedup``
    (replicated / ours), ``precond_bytes_max_over_mean`` (bytes of band state per rank: factors, bases, moments),
    ``ours_bytes_per_step`` / ``replicated_bytes_per_step`` (collective bytes per rank per step, max over ranks),
    ``ours_collectives_per_step``, ``max_rel_diff_vs_unsharded`` (ours vs the one-process run, max over params of
    max|diff| / max|ref|). ``json`` is accepted for the CLI's sake; the result is always a plain dict."""
    if steps < 2:
        raise ValueError(f"steps must be >= 2 (the first step is not timed), got {steps}")
    opt_kw = {"precondition_frequency": 2, **opt_kw}
    shapes = [tuple(s) for s in shapes]
    res = run_on_ranks(_rank, world_size, shapes, max_preconditioner_dim, steps, seed, opt_kw, timeout_s=timeout_s)
    ours_s = max(r["ours_s"] for r in res)
    rep_s = max(r["rep_s"] for r in res)
    pre = [r["precond_bytes"] for r in res]
    return {
        "world_size": world_size,
        "steps": steps,
        "shapes": [list(s) for s in shapes],
        "max_preconditioner_dim": max_preconditioner_dim,
        "precondition_frequency": opt_kw["precondition_frequency"],
        "ours_opt_step_s": ours_s,
        "replicated_opt_step_s": rep_s,
        "speedup": rep_s / ours_s if ours_s > 0 else float("inf"),
        "precond_bytes_per_rank": pre,
        "precond_bytes_max_over_mean": max(pre) / statistics.mean(pre) if sum(pre) else 1.0,
        "replicated_precond_bytes_per_rank": res[0]["rep_precond_bytes"],
        "ours_bytes_per_step": max(r["ours_bytes"] for r in res),
        "ours_collectives_per_step": max(r["ours_calls"] for r in res),
        "replicated_bytes_per_step": max(r["rep_bytes"] for r in res),
        "cut_bands": res[0]["cut_bands"],
        "max_rel_diff_vs_unsharded": max(r["diff"] for r in res),
    }


if __name__ == "__main__":
    import json as _json
    import sys

    print(_json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else 4), indent=1))
