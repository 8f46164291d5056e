"""Giving a second model the first one's layout, so that elementwise updates between their params pair up."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ragged_optim.sharding.fully_shard import units_of
from ragged_optim.sharding.unit_relayout import adopt_layout


def match_layout(model: nn.Module, like: nn.Module) -> None:
    """Lay out every unit of ``model`` as the matching unit of ``like``, a model of the same structure sharded the
    same way (an EMA copy, a teacher): their params' local pieces are then the same elements, so elementwise
    updates between them (``torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1 - decay)``,
    ``copy_``) pair up. Needed once ``like``'s optimizer has re-planned its units for its blocks (Muon, Shampoo,
    SOAP, AdamW8bit do at construction); without it the pieces differ, and such an update raises a size mismatch
    or, where two pieces happen to have the same length, mixes elements silently. A collective (data moves
    between ranks): call it on every rank after the optimizer over ``like`` is built, before ``model``'s layout is
    used by an optimizer's state. Nothing changes where the layouts already agree."""
    for name, m in (("model", model), ("like", like)):
        if not isinstance(m, nn.Module):
            raise TypeError(
                f"match_layout: {name} must be an nn.Module sharded with fully_shard, got a {type(m).__name__}"
            )
    mine, theirs = units_of(model), units_of(like)
    if len(mine) != len(theirs):
        raise ValueError(
            f"match_layout: the model has {len(mine)} fully_shard units and the one to match {len(theirs)}: shard "
            "both with the same fully_shard calls (the same modules, and the same params frozen)"
        )
    for a, b in zip(mine, theirs):
        same = (a.layout.names, a.layout.shapes, a.dtype, a.world_size, _ranks(a)) == (
            b.layout.names, b.layout.shapes, b.dtype, b.world_size, _ranks(b)
        )  # fmt: skip
        if not same:
            raise ValueError(
                f"match_layout: unit of {a.module_name} (params {list(a.layout.names)[:3]} with shapes "
                f"{[tuple(x) for x in a.layout.shapes][:3]}, {a.dtype}, world size {a.world_size}) differs from the "
                f"matching unit of {b.module_name} (params {list(b.layout.names)[:3]} with shapes "
                f"{[tuple(x) for x in b.layout.shapes][:3]}, {b.dtype}, world size {b.world_size}): the two models "
                "must have the same structure, shapes, dtypes and fully_shard calls, on the same mesh (shard group "
                f"ranks {_ranks(a)[0]} vs {_ranks(b)[0]})"
            )
    for a, b in zip(mine, theirs):
        adopt_layout(a, b.layout, b.specs, b.allow_split)


def _ranks(unit) -> tuple:
    """The global ranks of the unit's shard group and replica group: twins on other meshes hold other elements."""
    groups = (unit.group, getattr(unit, "replicate_group", None))
    if not dist.is_initialized():
        return ((), ())
    return tuple(tuple(dist.get_process_group_ranks(g)) if g is not None else () for g in groups)
