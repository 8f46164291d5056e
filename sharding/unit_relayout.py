"""Re-planning a unit's layout and moving its data to match: functions over a :class:`FlatUnit`.

A relayout is a one-time collective (every rank, before an optimizer keeps state shaped by the layout): the new
plan, then one all-to-all that sends each element of the local shard (and of the sharded grads, where any rank has
them) straight to its new owner, so it holds O(S) extra bytes, never the unit whole. The param objects are kept.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from ragged_optim.comm.collectives import all_reduce_flat, all_to_all_flat
from ragged_optim.sharding import unit_messages
from ragged_optim.sharding.layout import BlockSpec, Layout
from ragged_optim.sharding.sharded_param import local_of


def relayout(unit, specs: dict[int, BlockSpec], *, allow_split: bool | None = None, compute_load=None) -> bool:
    """Re-plan ``unit`` with new block specs for some params and move the data to match. Returns True when the
    layout changed."""
    new_specs = list(unit.specs)
    for i, s in specs.items():
        new_specs[i] = s
    split = unit.allow_split if allow_split is None else allow_split
    if new_specs == unit.specs and split == unit.allow_split:
        return False
    refuse_if_locked(unit, [unit.names[i] for i in specs])
    old_specs, old_split = unit.specs, unit.allow_split
    unit.specs, unit.allow_split = new_specs, split
    try:
        layout = unit.plan(unit.layout.shapes, compute_load)
    except BaseException:
        unit.specs, unit.allow_split = old_specs, old_split
        raise
    move_to(unit, layout)
    return True


def adopt_layout(unit, layout: Layout, specs, allow_split: bool) -> bool:
    """Take ``layout`` (another unit's of the same params: names, shapes, dtype, world size) and move the data to
    match. A collective, as :func:`relayout`. Returns True when the layout changed."""
    if layout == unit.layout:
        return False
    refuse_if_locked(unit, list(unit.names))
    unit.specs, unit.allow_split = list(specs), allow_split
    move_to(unit, layout)
    return True


def refuse_if_locked(unit, names) -> None:
    if unit.layout_locked:
        raise RuntimeError(unit_messages.layout_in_use(names))


def move_to(unit, layout: Layout) -> None:
    """Redistribute the local shard (and grads) from the unit's current layout to ``layout``."""
    old_layout, old_shard = unit.layout, unit.local_shard
    # Grads that exist (a backward ran before the optimizer was built, or before add_param_group) move with their
    # elements; a param has a grad afterwards where it had one on any rank.
    had = torch.tensor([sp.grad is not None for sp in unit.sharded_params], dtype=torch.float32)
    if unit.world_size > 1 and unit.device.type != "meta":  # (a model on meta has no grads to move)
        had = had.to(unit.device)
        all_reduce_flat(had, group=unit.group, op=dist.ReduceOp.MAX)
    had = [bool(h) for h in had.tolist()]
    old_grads = None
    if any(had):
        old_grads = torch.zeros(old_layout.shard_size, dtype=unit.dtype, device=unit.device)
        for i, sp in enumerate(unit.sharded_params):
            if sp.grad is not None:
                unit.shard_view(old_grads, i).copy_(local_of(sp.grad))
    unit.layout = layout
    unit.local_shard = redistribute(unit, old_layout, old_shard, layout)
    grads = redistribute(unit, old_layout, old_grads, layout) if old_grads is not None else None
    for i, sp in enumerate(unit.sharded_params):
        sp.grad = None  # (a grad of the old layout would not fit the param's new ranges)
        unit.repoint(sp, i)
        sp.grad = unit.as_ragged(unit.shard_view(grads, i), i) if had[i] else None
    unit._sharded_grad = weakref.ref(grads) if grads is not None else None
    unit.is_unsharded, unit.stale = False, True
    unit.drop_unsharded_params()


def _pieces(unit, src_layout: Layout, src_rank: int, dst_layout: Layout, dst_rank: int):
    """``(param, lo, hi)``: the runs of elements that ``src_rank`` holds under ``src_layout`` and ``dst_rank`` holds
    under ``dst_layout``, in param order."""
    for i in range(len(unit.sharded_params)):
        a_lo, a_hi = src_layout.local_range(src_rank, i)
        b_lo, b_hi = dst_layout.local_range(dst_rank, i)
        lo, hi = max(a_lo, b_lo), min(a_hi, b_hi)
        if hi > lo:
            yield i, lo, hi


def _at(layout: Layout, rank: int, i: int, lo: int) -> int:
    """Position of element ``lo`` of param i in ``rank``'s shard under ``layout``."""
    return layout.offsets[i] + lo - rank * layout.shard_size


@torch.no_grad()
def redistribute(unit, old: Layout, old_shard: torch.Tensor, new: Layout) -> torch.Tensor:
    """This rank's shard under ``new`` from every rank's shard under ``old``: one all-to-all."""
    rank = unit.rank
    send, in_splits = [], []
    for dst in range(unit.world_size):
        pieces = list(_pieces(unit, old, rank, new, dst))
        send += [old_shard[_at(old, rank, i, lo) : _at(old, rank, i, lo) + hi - lo] for i, lo, hi in pieces]
        in_splits.append(sum(hi - lo for _, lo, hi in pieces))
    recv_pieces = [list(_pieces(unit, old, src, new, rank)) for src in range(unit.world_size)]
    out_splits = [sum(hi - lo for _, lo, hi in pieces) for pieces in recv_pieces]
    inp = torch.cat(send) if send else old_shard[:0]
    out = torch.empty(sum(out_splits), dtype=unit.dtype, device=unit.device)
    if unit.world_size > 1:
        all_to_all_flat(out, inp, out_splits, in_splits, group=unit.group)
    else:
        out.copy_(inp)
    shard = torch.zeros(new.shard_size, dtype=unit.dtype, device=unit.device)
    pos = 0
    for pieces in recv_pieces:
        for i, lo, hi in pieces:
            start = _at(new, rank, i, lo)
            shard[start : start + hi - lo].copy_(out[pos : pos + hi - lo])
            pos += hi - lo
    return shard
