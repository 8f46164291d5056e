"""What every optimizer here shares: one view of the three kinds of params it may be given.

- plain tensors (one device): the whole param is local;
- ragged-sharded params (``ragged_optim.fully_shard``): a 1-D view of this rank's elements ``[lo, hi)`` of the
  flattened param; the optimizer declares block specs and the unit re-plans so those blocks are whole where they
  are computed (or owner-computed);
- torch ``DTensor`` params with any mix of ``Shard(d)``, ``_StridedShard`` and ``Replicate`` on a mesh of any dims
  (FSDP2's ``Shard(0)``: a row chunk, a ragged range as well; FSDP2 + TP, HSDP + TP: runs of the full tensor,
  :mod:`ragged_optim.sharding.dtensor_layout`).

Elementwise math runs on ``local(p)`` for all three; block math gets whole blocks through the block API
(:mod:`ragged_optim.optim.blocks`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ragged_optim.sharding import shard_info
from ragged_optim.sharding.dtensor_layout import dtensor_layout, exchange_group
from ragged_optim.sharding.sharded_param import full_shape  # noqa: F401  (re-exported: its home is the sharding layer)


def scalar(x) -> float:
    """A hyperparameter that may be a tensor (a tensor lr, as torch.optim allows) as a Python number."""
    return x.item() if isinstance(x, torch.Tensor) else x


def _foreach_devices() -> tuple[str, ...]:
    try:
        from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

        return tuple(_get_foreach_kernels_supported_devices())
    except ImportError:  # (a private torch helper; "cuda" is its answer where it exists)
        return ("cuda",)


def on_foreach_device(tensors) -> bool:
    """Whether every tensor is on a device with native ``torch._foreach_*`` kernels (CUDA, XPU): one multi-tensor
    kernel per op there. A CPU runs foreach ops as a loop over the tensors, each visited once per op (torch.optim's
    ``foreach=None`` draws the same line)."""
    devices = _foreach_devices()
    return all(t.device.type in devices for t in tensors)


def is_dtensor(t: torch.Tensor) -> bool:
    """A DTensor param whose ranks' elements a :class:`~ragged_optim.sharding.dtensor_layout.DTensorLayout` gives:
    torch's (FSDP2's ``Shard(0)``, FSDP2 + TP), and a tensor-parallel param ragged-sharded by ``fully_shard`` (its
    ranks' runs over the joint (dp, tp) mesh). Not a plain ragged-sharded param (a DTensor too, whose layout is its
    unit's, one range per rank: ``shard_info``)."""
    if not (hasattr(t, "to_local") and hasattr(t, "placements")):
        return False
    info = shard_info(t)
    return info is None or info.tp is not None


def ragged_info(p: torch.Tensor):
    """The ShardInfo of a ragged-sharded param laid out by its unit alone (one range per rank of the unit's group);
    None for any other param, a tensor-parallel ragged one included (:func:`is_dtensor`)."""
    info = shard_info(p)
    return info if info is not None and info.tp is None else None


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor this rank computes on in place: a DTensor's local shard (a ragged param's 1-D piece of the flat
    buffer), anything else as is."""
    if t is not None and hasattr(t, "to_local") and hasattr(t, "placements"):
        return t.to_local()
    return t


def process_group(p: torch.Tensor):
    """The group a distributed param's blocks are exchanged over (None for a plain tensor)."""
    info = shard_info(p)
    if info is not None and info.tp is not None:  # its blocks span the dp and tp dims: the joint mesh's ranks
        return exchange_group(info.tp.exchange_mesh)
    if info is not None:
        return info.unit.group
    if is_dtensor(p):
        return dtensor_layout(p).group  # (the flattened mesh for an N-D one: blocks get owners over all its ranks)
    return None


def local_ranges(p: torch.Tensor) -> list[tuple[int, int]]:
    """Every rank's flat element range ``[lo, hi)`` of a distributed param whose ranks each hold one range (ragged
    params, FSDP2's ``Shard(0)`` on a 1-D mesh); for other DTensor layouts see :func:`runs_of_rank`."""
    info = ragged_info(p)
    if info is not None:
        layout = info.unit.layout
        return [layout.local_range(r, info.index) for r in range(layout.world_size)]
    ranges = dtensor_layout(p).ranges()
    if ranges is None:
        raise ValueError(
            f"a DTensor param with placements {tuple(p.placements)} on a {p.device_mesh.ndim}-D mesh has no one "
            "flat range per rank: use runs_of_rank(p, rank) / local_slice(p, s, e)"
        )
    return ranges


def is_range_layout(p: torch.Tensor) -> bool:
    """Whether every rank of a distributed param holds one flat range of it, alone (see :func:`local_ranges`)."""
    return not is_dtensor(p) or dtensor_layout(p).ranges() is not None


def runs_of_rank(p: torch.Tensor, rank: int, *, replicas: bool = False) -> list[tuple[int, int, int]]:
    """The runs ``(start, end, local start)`` of the full flat param whose blocks rank ``rank`` (of the param's
    process group) may compute where they lie: its own range for a ragged or a 1-D FSDP2 param, its runs for an
    N-D DTensor held by that rank alone; none for a rank whose elements replicas hold too (those blocks are computed
    once, by an owner, and its result sent to every replica; ``replicas=True``: its runs all the same)."""
    if is_dtensor(p):
        h = dtensor_layout(p).holding(rank)
        if len(h.ranks) > 1 and not replicas:
            return []
        return list(zip(h.starts, (s + n for s, n in zip(h.starts, h.lens)), h.lstarts))
    lo, hi = local_ranges(p)[rank]
    return [(lo, hi, 0)] if hi > lo else []


def local_slice(p: torch.Tensor, s: int, e: int) -> tuple[int, int]:
    """This rank's elements of the full param's flat range ``[s, e)``: a slice ``[a, b)`` of its flat local tensor
    (empty when it holds none of them)."""
    if is_dtensor(p):
        return dtensor_layout(p).holding().slice_of(s, e)
    lo, hi = local_range(p)
    a, b = max(lo, s), min(hi, e)
    return (a - lo, b - lo) if b > a else (0, 0)


def local_range(p: torch.Tensor) -> tuple[int, int]:
    """This rank's flat element range ``[lo, hi)`` of the full param (``(0, numel)`` for a plain tensor)."""
    info = ragged_info(p)
    if info is not None:
        return info.local_range
    group = process_group(p)
    if group is not None:
        return local_ranges(p)[dist.get_rank(group)]
    return 0, local(p).numel()


def local_of_full(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's elements of a full-shape tensor of ``p``, shaped like ``local(p)``."""
    if is_dtensor(p):
        return dtensor_layout(p).local_of_full(full).view(local(p).shape)
    lo, hi = local_range(p)
    return full.reshape(-1)[lo:hi].view(local(p).shape)
