"""Global gradient norm and clipping across ranks, for ragged-sharded, DTensor and plain params together."""

from __future__ import annotations

import numbers

import torch
import torch.distributed as dist

from ragged_optim.comm.collectives import all_reduce_flat
from ragged_optim.sharding.sharded_param import shard_info


def _groups_of(params):
    """Sharded params grouped by their unit's process group (each group reduces its own partial sums)."""
    by_group: dict = {}
    replicated = []
    for p in params:
        info = shard_info(p)
        if info is not None:
            by_group.setdefault(info.unit.group, []).append(p)
        elif hasattr(p, "to_local"):
            sharded = [d for d, pl in enumerate(p.placements) if pl.is_shard()]
            if not sharded:  # replicated on every mesh dim: each rank holds the whole grad
                replicated.append(p)
            elif len(sharded) == 1:  # FSDP2 (1-D) or HSDP (Replicate, Shard): partial sums over the shard dim
                by_group.setdefault(p.device_mesh.get_group(sharded[0]), []).append(p)
            else:
                raise ValueError(
                    f"clip_grad_norm_: a DTensor param with placements {tuple(p.placements)} is sharded over "
                    f"{len(sharded)} mesh dims; only one sharded dim is supported (FSDP2 and HSDP meshes). Use "
                    "torch.nn.utils.clip_grad_norm_ for it"
                )
        else:
            replicated.append(p)
    return by_group, replicated


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def total_grad_norm(params, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all grads as if unsharded (a collective over each unit's group; call it on every rank)."""
    params = [p for p in params if p is not None]
    if norm_type != 2.0 and norm_type != float("inf"):
        raise ValueError(f"clip_grad_norm_: norm_type must be 2.0 or inf, got {norm_type}")
    by_group, replicated = _groups_of(params)
    is_inf = norm_type == float("inf")
    device = _local(params[0]).device if params else torch.device("cpu")  # NCCL reduces device tensors only
    total = torch.zeros((), dtype=torch.float64, device=device)
    for group in by_group:  # every rank sees its units in the same order, so the all-reduces pair up
        part = torch.zeros((), dtype=torch.float64, device=device)
        for p in by_group[group]:
            if p.grad is not None and _local(p.grad).numel():
                g = _local(p.grad).detach().double()
                part = torch.maximum(part, g.abs().max()) if is_inf else part + g.pow(2).sum()
        all_reduce_flat(part, group=group, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM)
        total = torch.maximum(total, part) if is_inf else total + part
    for p in replicated:
        if p.grad is not None and p.grad.numel():
            g = _local(p.grad).detach().double()
            total = torch.maximum(total, g.abs().max()) if is_inf else total + g.pow(2).sum()
    return (total if is_inf else total.sqrt()).float()


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale all grads so that their global norm is at most ``max_norm``; returns the norm before clipping."""
    is_number = isinstance(max_norm, numbers.Real) or (isinstance(max_norm, torch.Tensor) and max_norm.numel() == 1)
    limit = float(max_norm) if is_number else float("nan")
    if not limit >= 0:  # checked before the collective, so every rank raises together; NaN fails too
        raise ValueError(
            f"clip_grad_norm_: max_norm must be a number >= 0 (the largest global grad norm to allow), got "
            f"{max_norm!r}; a negative max_norm would flip the gradients' signs"
        )
    if isinstance(params, torch.Tensor):
        params = [params]
    params = list(params)
    norm = total_grad_norm(params, norm_type)
    coef = (limit / (norm.double() + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            _local(p.grad).mul_(coef.to(_local(p.grad).dtype))
    return norm
