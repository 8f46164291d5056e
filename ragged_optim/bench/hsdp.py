"""`bench hsdp`: HSDP (2-D replicate x shard mesh) against FSDP over every rank, same model, data and run.

Measured: collective message bytes per training step on one rank (all-gathers and reduce-scatters inside the shard
group, plus the all-reduce of the local shard across replicas), step time, and both runs' params against a
one-process run. Modelled: ring-algorithm wire bytes per rank per step as W grows, from the planner's shard sizes
(``comm_model``), checked against the measured message sizes at the measured W.
"""

from __future__ import annotations

import torch

from ragged_optim.bench.training import train_config
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.data import get_batch
from ragged_optim.models import build_model, get_config
from ragged_optim.train import shard_model

DESCRIPTION = "HSDP (replicate x shard) vs FSDP: bytes, step time, parity; wire-byte model up to W=8192"


def comm_model(model_bytes: float, world_size: int, shard_size: int) -> dict:
    """Per-rank wire bytes of one training step (two all-gathers and one reduce-scatter of the model, ring
    algorithm: each rank sends (n-1)/n of the buffer), for FSDP over ``world_size`` ranks and HSDP with shard
    groups of ``shard_size``. HSDP adds an all-reduce of the 1/shard_size local shard across the replicas (a ring
    all-reduce sends 2 (r-1)/r of it); only that part crosses between replicas."""
    w, g = world_size, min(shard_size, world_size)
    r = w // g
    fsdp = 3 * (w - 1) / w * model_bytes
    hsdp_in_group = 3 * (g - 1) / g * model_bytes
    cross = 2 * (r - 1) / r * model_bytes / g if r > 1 else 0.0
    return {
        "world_size": w,
        "shard_size": g,
        "fsdp_wire_bytes_per_rank": fsdp,
        "hsdp_wire_bytes_per_rank": hsdp_in_group + cross,
        "hsdp_cross_replica_bytes_per_rank": cross,
        "fsdp_ranks_per_collective": w,
        "hsdp_ranks_per_collective": g,
    }


def _rank(rank, world_size, cfg, steps, batch_size, lr, shard_size):
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_optim.sharding import units_of

    mesh = init_device_mesh("cpu", (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))
    predicted = {}

    def shard(model, mesh=None, key="fsdp"):
        shard_model(model, "ours", mesh=mesh)
        units = units_of(model)
        # message sizes: each unit's W*S buffer all-gathered for forward and again for backward (not the root: it
        # stays unsharded in between) and reduce-scattered once; HSDP adds an all-reduce of S across replicas
        root = units[-1]
        buf = sum((2 if u is root else 3) * u.layout.total_size * 4 for u in units)
        predicted[key] = buf + (sum(u.layout.shard_size * 4 for u in units) if mesh is not None else 0)

    fsdp = train_config(rank, world_size, cfg, steps, batch_size, lr, shard)
    hsdp = train_config(rank, world_size, cfg, steps, batch_size, lr, lambda m: shard(m, mesh, "hsdp"))
    return {"fsdp": fsdp, "hsdp": hsdp, "predicted": predicted}


def _single(cfg, steps, batch_size, lr, world_size):
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for step in range(steps):
        for r in range(world_size):
            x, y = get_batch("train", batch_size, cfg.seq_len, step, r, world_size, 0)
            (model(x, y) / world_size).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach() for n, p in model.named_parameters()}


def run(world_size: int = 4, steps: int | None = None, *, preset: str = "small", batch_size: int = 24, lr=1e-3):
    """``steps`` (default 6) AdamW steps of FSDP over ``world_size`` ranks and of HSDP 2 x (world_size / 2)."""
    steps = 6 if steps is None else steps
    if world_size % 2:
        raise ValueError(f"bench hsdp needs an even world size (2 replicas), got {world_size}")
    shard_size = world_size // 2
    cfg = get_config(preset)
    res = run_on_ranks(_rank, world_size, cfg, steps, batch_size, lr, shard_size, timeout_s=1800)
    r0 = res[0]
    single = _single(cfg, steps, batch_size, lr, world_size)
    diff = lambda params: max((params[n] - single[n]).abs().max().item() for n in single)
    model_bytes = sum(p.numel() * 4 for p in single.values())
    return {
        "world_size": world_size,
        "mesh": [2, shard_size],
        "preset": preset,
        "steps": steps,
        "fsdp_bytes_per_step": r0["fsdp"]["bytes_per_step"],
        "hsdp_bytes_per_step": r0["hsdp"]["bytes_per_step"],
        "predicted_fsdp_bytes_per_step": r0["predicted"]["fsdp"],
        "predicted_hsdp_bytes_per_step": r0["predicted"]["hsdp"],
        "hsdp_step_time_ratio_vs_fsdp": r0["hsdp"]["step_s"] / r0["fsdp"]["step_s"],
        "max_abs_diff_vs_single": diff(r0["hsdp"]["params"]),
        "fsdp_max_abs_diff_vs_single": diff(r0["fsdp"]["params"]),
        "replicas_identical": all(
            torch.equal(res[0]["hsdp"]["params"][n], res[shard_size]["hsdp"]["params"][n]) for n in single
        ),
        "comm_model_g256": [comm_model(model_bytes, w, 256) for w in (256, 512, 1024, 2048, 4096, 8192)],
    }
