"""The layout lifecycle of units under an optimizer: declare blocks, agree across ranks, re-plan, assign owners, lock.

An optimizer says which blocks of which params must be whole (:func:`declare_blocks`); every ragged unit concerned
re-plans once, and who computes its owner-computed and cut blocks is balanced over each process group. From the
first step on, optimizer state is shaped by those layouts (:func:`lock_layouts`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.distributed as dist
from torch import Tensor

from ragged_optim.comm.collectives import same_on_every_rank
from ragged_optim.sharding.layout import BlockSpec
from ragged_optim.sharding.owner_balance import default_block_cost
from ragged_optim.sharding.planner import assign_owners_jointly
from ragged_optim.sharding.ragged_tp_layout import share_tensor_parallel_runs, tp_local_spec
from ragged_optim.sharding.sharded_param import full_shape, shard_info
from ragged_optim.sharding.unit_relayout import relayout


def declare_blocks(
    entries: Sequence[tuple[Tensor, BlockSpec]],
    *,
    allow_split: bool = True,
    block_cost: Callable[[Tensor, BlockSpec, int], float] | None = None,
    balance_whole_blocks: bool = False,
    params: Sequence[Tensor] = (),
) -> None:
    """Tell the sharding layer which blocks of which params must be whole: every ragged unit concerned re-plans once
    (a collective: every rank calls it with the same entries, in the same order, before the first step). With
    ``allow_split=False`` no rank boundary may cut a block (8-bit quantization blocks); otherwise the planner may cut
    a block and mark it owner-computed. Then who computes the owner-computed and cut blocks (and, with
    ``balance_whole_blocks``, whole blocks too) is balanced over each process group by ``block_cost(p, spec,
    numel)`` (default: the Newton-Schulz cost of the block's matrix view). Plain and DTensor params need nothing.
    Tensor-parallel ragged params (``fully_shard`` after ``parallelize_module``) re-plan their TP-local parts, and
    every rank's runs of them (of these entries and of ``params``) are shared over their joint (dp, tp) mesh: their
    blocks get owners over all its ranks, at the step
    (:class:`~ragged_optim.sharding.block_routing.BlockRouting`)."""
    entries = list(entries)
    for p, spec in entries:
        if not isinstance(spec, BlockSpec):
            raise TypeError(
                f"the block spec of a param of shape {tuple(full_shape(p))} must be a ragged_optim.BlockSpec, got "
                f"{type(spec).__name__}: {spec!r}"
            )
    by_unit: dict[int, tuple] = {}  # id(unit): (unit, {index: spec}, indices of TP params)
    param_at: dict[tuple[int, int], Tensor] = {}
    for p, spec in entries:
        info = shard_info(p)
        if info is None:
            continue
        unit = info.unit
        held = by_unit.setdefault(id(unit), (unit, {}, set()))
        if info.tp is not None:  # its TP-local part: the blocks to keep whole there, if any; owners come later
            spec = tp_local_spec(spec, info.tp.shape, info.tp.offsets, info.tp.local_shape)
            if spec is None:
                continue
            held[2].add(info.index)
        held[1][info.index] = spec
        param_at[(id(unit), info.index)] = p
    for unit, specs, _ in by_unit.values():
        _refuse_meta(unit, specs)
    _check_ranks_agree([(unit, specs) for unit, specs, _ in by_unit.values()], allow_split)
    groups: dict = {}
    for unit, specs, _ in by_unit.values():
        relayout(unit, specs, allow_split=allow_split)
        groups.setdefault(id(unit.group), []).append(unit)
    for units in groups.values():  # owners of all units of a group, balanced together (largest block first)

        def cost(t, i, shape, spec, numel, units=units):
            p = param_at[(id(units[t]), i)]
            return default_block_cost(shape, spec, numel) if block_cost is None else block_cost(p, spec, numel)

        layouts = assign_owners_jointly(
            [u.layout for u in units],
            block_cost=cost,
            tensors=[set(by_unit[id(u)][1]) - by_unit[id(u)][2] for u in units],
            balance_whole_blocks=balance_whole_blocks,
        )
        for unit, layout in zip(units, layouts):
            unit.set_owners(layout)
    share_tensor_parallel_runs(list({id(p): p for p in [*(p for p, _ in entries), *params]}.values()))


def lock_layouts(params) -> None:
    """From the first step on, optimizer state is shaped by the current layouts: forbid re-planning them."""
    for p in params:
        info = shard_info(p)
        if info is not None:
            info.unit.lock()


def _refuse_meta(unit, specs) -> None:
    """Re-planning moves data between ranks, which params on the meta device do not have yet."""
    if unit.device.type == "meta" and unit.world_size > 1 and specs:
        raise RuntimeError(
            f"an optimizer was built on params still on the meta device ({unit.names[0]!r}, ...): its block "
            "layout re-plans their units, which moves data between ranks. Build optimizers after "
            "model.to_empty(device=...) and ro.init_weights(model)"
        )


def _check_ranks_agree(requests: list[tuple], allow_split: bool) -> None:
    """A relayout is a collective that a rank skips when its specs change nothing, so ranks that build an optimizer
    over different params or settings would deadlock or mix layouts. One all_reduce per process group compares a
    digest of every rank's request first, and all ranks raise together on a mismatch."""
    by_group: dict[int, tuple] = {}
    for unit, specs in requests:
        by_group.setdefault(id(unit.group), (unit.group, unit.device, []))[2].append((unit, specs))
    for group, device, entries in by_group.values():
        if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
            continue
        request = sorted(
            (tuple(unit.names), sorted((i, s.block, s.period, s.owner_computed, s.tile_cols) for i, s in specs.items()))
            for unit, specs in entries
        )
        if not same_on_every_rank(repr((request, allow_split)), group, device):
            n = sum(len(specs) for _, specs in entries)
            names = [unit.names[i] for unit, specs in entries for i in specs][:3]
            raise ValueError(
                f"ranks build this optimizer over different sharded params or settings (this rank: {n} params in "
                f"{len(entries)} units, e.g. {names}); construct every optimizer on every rank with the same params, "
                "in the same order, with the same hyperparameters"
            )
