"""What a sharded parameter knows about itself, and how to get its full value back."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ragged_optim.sharding.flat_unit import FlatUnit

_INFO_ATTR = "_ragged_shard"


@dataclass
class ShardInfo:
    """Attached to every sharded parameter: ``param`` is a 1-D view of elements ``[lo, hi)`` of the flattened
    tensor of shape ``shape``, living in ``unit``'s local shard."""

    unit: FlatUnit
    index: int  # the tensor's index in unit.layout
    name: str  # the parameter's name inside the unit's module

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.unit.layout.shapes[self.index])

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def local_range(self) -> tuple[int, int]:
        return self.unit.layout.local_range(self.unit.rank, self.index)


def shard_info(param: torch.Tensor) -> ShardInfo | None:
    """The ShardInfo of a ragged-sharded parameter, or None for any other tensor."""
    return getattr(param, _INFO_ATTR, None)


def is_ragged_sharded(param: torch.Tensor) -> bool:
    return shard_info(param) is not None


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The full, unsharded value of a parameter (a collective on its unit's group: call it on every rank).

    Plain tensors come back as they are; torch DTensors through ``full_tensor()``."""
    info = shard_info(param)
    if info is None:
        if hasattr(param, "full_tensor"):
            return param.full_tensor()
        return param.detach()
    return info.unit.gather_full(info.index, param.detach())


def full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The full gradient of a sharded parameter (a collective), or None when it has none on every rank."""
    info = shard_info(param)
    if info is None:
        return None if param.grad is None else full_tensor(param.grad)
    local = param.grad if param.grad is not None else torch.zeros_like(param)
    return info.unit.gather_full(info.index, local.detach())
