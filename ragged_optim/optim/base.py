"""What every optimizer here shares: one view of the three kinds of params it may be given.

- plain tensors (one device): the whole param is local;
- ragged-sharded params (``ragged_optim.fully_shard``): a 1-D view of this rank's elements ``[lo, hi)`` of the
  flattened param; the optimizer declares block specs and the unit re-plans so those blocks are whole where they
  are computed (or owner-computed);
- torch FSDP2 ``DTensor`` params sharded ``Shard(0)``: this rank's row chunk, a ragged range as well.

Elementwise math runs on ``local(p)`` for all three; block math gets whole blocks through the block API
(:mod:`ragged_optim.optim.blocks`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ragged_optim.sharding import shard_info
from ragged_optim.sharding.owner_routes import dtensor_local_ranges
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
    """A torch DTensor param laid out by its placements (FSDP2's ``Shard(0)``), not a ragged-sharded param (a
    DTensor too, whose layout comes from its unit: ``shard_info``)."""
    return hasattr(t, "to_local") and hasattr(t, "placements") and shard_info(t) is None


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor this rank computes on in place: a DTensor's local shard (a ragged param's 1-D piece of the flat
    buffer), anything else as is."""
    if t is not None and hasattr(t, "to_local") and hasattr(t, "placements"):
        return t.to_local()
    return t


def process_group(p: torch.Tensor):
    """The group a distributed param's blocks are exchanged over (None for a plain tensor)."""
    info = shard_info(p)
    if info is not None:
        return info.unit.group
    if is_dtensor(p):
        return p.device_mesh.get_group()
    return None


def local_ranges(p: torch.Tensor) -> list[tuple[int, int]]:
    """Every rank's flat element range ``[lo, hi)`` of a distributed param."""
    info = shard_info(p)
    if info is not None:
        layout = info.unit.layout
        return [layout.local_range(r, info.index) for r in range(layout.world_size)]
    return dtensor_local_ranges(p)


def ns_cost(numel: int, matrix_shape: tuple[int, int]) -> float:
    m, n = matrix_shape
    return float(m) * n * min(m, n)


def local_range(p: torch.Tensor) -> tuple[int, int]:
    """This rank's flat element range ``[lo, hi)`` of the full param (``(0, numel)`` for a plain tensor)."""
    info = shard_info(p)
    if info is not None:
        return info.local_range
    group = process_group(p)
    if group is not None:
        return local_ranges(p)[dist.get_rank(group)]
    return 0, local(p).numel()
