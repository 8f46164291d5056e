"""What a sharded parameter knows about itself, and how to get its full value back."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ragged_optim.sharding.unit_collectives import gather_full

if TYPE_CHECKING:
    from ragged_optim.sharding.flat_unit import FlatUnit

_INFO_ATTR = "_ragged_shard"
# Every unit that has sharded a param, so full_tensor can recognise a sharded param's .grad (a plain 1-D tensor).
_LIVE_UNITS: weakref.WeakSet = weakref.WeakSet()


@dataclass
class ShardInfo:
    """Attached to every sharded parameter: a RaggedDTensor of full shape ``shape`` whose local tensor is a 1-D
    view of elements ``[lo, hi)`` of the flattened tensor, living in ``unit``'s local shard."""

    unit: FlatUnit
    index: int  # the tensor's index in unit.layout
    name: str  # the parameter's name inside the unit's module

    def __post_init__(self) -> None:
        _LIVE_UNITS.add(self.unit)

    @property
    def shape(self) -> torch.Size:
        """The param's full shape (under tensor parallel the global one; the unit lays out its TP-local block)."""
        tp = self.tp
        return torch.Size(self.unit.layout.shapes[self.index]) if tp is None else tp.shape

    @property
    def tp(self):
        """The param's TensorParallelPart, or None for a param without tensor parallel."""
        return self.unit.tp_parts[self.index]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def local_range(self) -> tuple[int, int]:
        return self.unit.layout.local_range(self.unit.rank, self.index)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a ragged-sharded param or grad (its local tensor, a view into the unit's flat buffer);
    any other tensor as it is."""
    return t._local_tensor if hasattr(t, "_ragged_ranges") else t


def shard_info(param: torch.Tensor) -> ShardInfo | None:
    """The ShardInfo of a ragged-sharded parameter, or None for any other tensor."""
    return getattr(param, _INFO_ATTR, None)


def full_shape(p: torch.Tensor) -> torch.Size:
    """The param's unsharded shape, whatever kind it is (a DTensor's own shape is the full one)."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"full_shape: takes one param (a tensor), got a {type(p).__name__}")
    info = shard_info(p)
    return info.shape if info is not None else p.shape


def is_ragged_sharded(param: torch.Tensor) -> bool:
    return shard_info(param) is not None


def _check_tensor(what: str, param) -> None:
    if not isinstance(param, torch.Tensor):  # (else an AttributeError from inside, naming nothing)
        raise TypeError(f"{what}: takes one param (a tensor), got a {type(param).__name__}; for a model or a list, "
                        "call it on each param")  # fmt: skip


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The full, unsharded value of a parameter (a collective on its unit's group: call it on every rank).

    Plain tensors come back as they are; DTensors (torch's, and ours: sharded params and their grads) through
    ``full_tensor()``. The local piece of a sharded param's grad (``p.grad.to_local()``) is recognised and gathered
    as ``full_grad(param)`` does."""
    _check_tensor("full_tensor", param)
    info = shard_info(param)
    if info is None:
        if hasattr(param, "full_tensor"):
            return param.full_tensor()
        owner = _grad_owner(param)
        if owner is not None:
            return full_grad(owner)
        return param.detach()
    return gather_full(info.unit, info.index, local_of(param).detach())


def full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The full gradient of a parameter (a collective on its unit's group: call it on every rank), or None when a
    plain param has none. A sharded param with no grad on this rank contributes zeros. Works for ragged-sharded
    params, torch DTensor params and plain ones alike."""
    _check_tensor("full_grad", param)
    info = shard_info(param)
    if info is None:
        return None if param.grad is None else full_tensor(param.grad)
    local = local_of(param.grad) if param.grad is not None else torch.zeros_like(local_of(param))
    return gather_full(info.unit, info.index, local.detach())


def _grad_owner(tensor: torch.Tensor) -> torch.Tensor | None:
    """The sharded param whose ``.grad``'s local piece is ``tensor`` (the same object), or None."""
    if tensor.dim() != 1:
        return None
    for unit in list(_LIVE_UNITS):
        for sp in getattr(unit, "sharded_params", ()):
            if sp.grad is not None and local_of(sp.grad) is tensor:
                return sp
    return None
