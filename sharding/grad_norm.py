"""Global gradient norm and clipping across ranks, for ragged-sharded, DTensor and plain params together."""

from __future__ import annotations

import math
import numbers

import torch
import torch.distributed as dist

from ragged_optim.comm.collectives import all_reduce_flat
from ragged_optim.sharding.sharded_param import full_shape, shard_info


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


def _norm_type(norm_type) -> float:
    """``norm_type`` as torch's clip_grad_norm_ takes it (a number, or "inf"), checked: p > 0 or inf."""
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        p = float("nan")
    if not p > 0:  # NaN fails too
        raise ValueError(
            f"clip_grad_norm_: norm_type must be a number > 0 or inf (2.0: the Euclidean norm), got {norm_type!r}"
        )
    return p


@torch.no_grad()
def total_grad_norm(params, norm_type: float | str = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of all grads as if unsharded (a collective over each unit's group; call it on every
    rank). Computed in float64: the p-th powers of every local element summed per group, one all-reduce each."""
    params = [p for p in params if p is not None]
    p_norm = _norm_type(norm_type)
    by_group, replicated = _groups_of(params)
    is_inf = p_norm == float("inf")

    def add(acc, g):
        g = _local(g).detach().double()
        if is_inf:
            return torch.maximum(acc, g.abs().max())
        return acc + (g.pow(2).sum() if p_norm == 2.0 else g.abs().pow(p_norm).sum())

    device = _local(params[0]).device if params else torch.device("cpu")  # NCCL reduces device tensors only
    total = torch.zeros((), dtype=torch.float64, device=device)
    for group in by_group:  # every rank sees its units in the same order, so the all-reduces pair up
        part = torch.zeros((), dtype=torch.float64, device=device)
        for p in by_group[group]:
            if p.grad is not None and _local(p.grad).numel():
                part = add(part, p.grad)
        part = _reduce_checked(part, by_group[group], group, is_inf)
        total = torch.maximum(total, part) if is_inf else total + part
    for p in replicated:
        if p.grad is not None and p.grad.numel():
            total = add(total, p.grad)
    return (total if is_inf else total.pow(1.0 / p_norm)).float()


def _reduce_checked(part: torch.Tensor, params: list, group, is_inf: bool) -> torch.Tensor:
    """All-reduce a group's partial norm together with a digest of the params each rank passed (their count and
    total full size), in the same collective: ranks that passed different params (a list filtered per rank, e.g.
    by ``p.grad is not None``) got a "global" norm of a mix, silently; now every rank raises the same error. With
    SUM, a digest d agrees on every rank iff W * sum(d**2) == sum(d)**2; with MAX, iff max(d) == -max(-d)."""
    count = float(len(params))
    size = float(sum(math.prod(full_shape(p)) for p in params) % 65521)  # (small: its square stays exact)
    digest = (count, -count, size, -size) if is_inf else (count, count * count, size, size * size)
    buf = torch.cat([part.reshape(1), torch.tensor(digest, dtype=torch.float64, device=part.device)])
    all_reduce_flat(buf, group=group, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM)
    d = buf[1:]
    world = dist.get_world_size(group)
    same = (d[0] == -d[1]) & (d[2] == -d[3]) if is_inf else (world * d[1] == d[0] ** 2) & (world * d[3] == d[2] ** 2)
    if buf.device.type == "cpu":  # (on a GPU, reading it would be a host sync every step: the norm is NaN instead)
        if not bool(same):
            raise ValueError(
                "clip_grad_norm_: the ranks passed different params (another count or total size on some rank); "
                "pass the same params on every rank, e.g. model.parameters(), not a list filtered per rank by p.grad"
            )
        return buf[0]
    return torch.where(same, buf[0], torch.full_like(buf[0], float("nan")))


@torch.no_grad()
def clip_grad_norm_(
    parameters,
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Scale all grads so that their global norm is at most ``max_norm``; returns the norm before clipping.
    ``torch.nn.utils.clip_grad_norm_``'s arguments; the norm is global (a collective: call it on every rank).
    ``error_if_nonfinite``: raise (on every rank, before any grad changes) when the norm is NaN or inf.
    ``foreach`` is accepted for torch's signature and changes nothing here."""
    del foreach
    is_number = isinstance(max_norm, numbers.Real) or (isinstance(max_norm, torch.Tensor) and max_norm.numel() == 1)
    limit = float(max_norm) if is_number else float("nan")
    if not limit >= 0:  # checked before the collective, so every rank raises together; NaN fails too
        raise ValueError(
            f"clip_grad_norm_: max_norm must be a number >= 0 (the largest global grad norm to allow), got "
            f"{max_norm!r}; a negative max_norm would flip the gradients' signs"
        )
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = list(parameters)
    norm = total_grad_norm(params, norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):  # the same global norm on every rank: all raise
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {float(norm_type)} of the gradients is non-finite, so it "
            "cannot be clipped; the gradients are unchanged. To scale them by the non-finite norm anyway, set "
            "error_if_nonfinite=False"
        )
    coef = (limit / (norm.double() + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            _local(p.grad).mul_(coef.to(_local(p.grad).dtype))
    return norm
