"""What every optimizer here shares: one view of the three kinds of params it may be given.

- plain tensors (one device): the whole param is local;
- ragged-sharded params (``ragged_optim.fully_shard``): a 1-D view of this rank's elements ``[lo, hi)`` of the
  flattened param; the optimizer declares block specs and the unit re-plans so those blocks are whole where they
  are computed (or owner-computed);
- torch FSDP2 ``DTensor`` params sharded ``Shard(0)``: this rank's row chunk, a ragged range as well.

Elementwise math runs on ``local(p)`` for all three; block math gets whole blocks through ``OwnerExchange``.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
import torch.distributed as dist

from ragged_optim.comm.owner_exchange import BlockRoute, OwnerExchange
from ragged_optim.sharding import BlockSpec, shard_info
from ragged_optim.sharding.owner_routes import (
    balanced_owners,
    blocks_over_ranges,
    dtensor_local_ranges,
    ragged_routes,
)
from ragged_optim.sharding.planner import assign_owners_jointly


def scalar(x) -> float:
    """A hyperparameter that may be a tensor (a tensor lr, as torch.optim allows) as a Python number."""
    return x.item() if isinstance(x, torch.Tensor) else x


def is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements")


def full_shape(p: torch.Tensor) -> torch.Size:
    """The param's unsharded shape, whatever kind it is."""
    info = shard_info(p)
    return info.shape if info is not None else p.shape


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor this rank computes on in place: a DTensor's local shard, anything else as is."""
    if t is not None and is_dtensor(t):
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


def request_block_specs(entries: list[tuple[torch.Tensor, BlockSpec]], *, allow_split: bool = True) -> None:
    """Ask the sharding layer to keep these blocks whole: each ragged unit concerned re-plans once (a collective
    on its group; every rank must call this with the same entries, in the same order). Owner compute is balanced
    jointly across the units of one group. Plain and DTensor params need nothing here."""
    by_unit: dict[int, tuple] = {}
    for p, spec in entries:
        info = shard_info(p)
        if info is None:
            continue
        unit = info.unit
        by_unit.setdefault(id(unit), (unit, {}))[1][info.index] = spec
    _check_ranks_agree(list(by_unit.values()), allow_split)
    groups: dict = {}
    for unit, specs in by_unit.values():
        unit.relayout(specs, allow_split=allow_split)
        groups.setdefault(id(unit.group), []).append(unit)
    for units in groups.values():  # owners of all units of a group, balanced together (largest matrix first)
        for unit, layout in zip(units, assign_owners_jointly([u.layout for u in units])):
            unit.layout = layout


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
            (tuple(unit.names), sorted((i, s.block, s.period, s.owner_computed) for i, s in specs.items()))
            for unit, specs in entries
        )
        digest = int.from_bytes(hashlib.sha256(repr((request, allow_split)).encode()).digest()[:7], "little")
        both = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        if both[0].item() != -both[1].item():
            n = sum(len(specs) for _, specs in entries)
            names = [unit.names[i] for unit, specs in entries for i in specs][:3]
            raise ValueError(
                f"ranks build this optimizer over different sharded params or settings (this rank: {n} params in "
                f"{len(entries)} units, e.g. {names}); construct every optimizer on every rank with the same params, "
                "in the same order, with the same hyperparameters"
            )


def lock_layouts(params) -> None:
    """From the first step on, optimizer state is shaped by the current layouts: forbid re-planning them."""
    for p in params:
        info = shard_info(p)
        if info is not None:
            info.unit.layout_locked = True


def ns_cost(numel: int, matrix_shape: tuple[int, int]) -> float:
    m, n = matrix_shape
    return float(m) * n * min(m, n)


class BlockPlan:
    """Routes for the owner-computed blocks of a list of distributed params that share one process group.

    ``item_routes[k]``: for param k, ``(route index, block start, block end)`` in tensor order; ``exchange`` moves
    every block in one all_to_all each way."""

    def __init__(self, params: list[torch.Tensor], spec_of, cost_of, group, *, only_cut: bool = False):
        """``spec_of(p)``: the param's BlockSpec (DTensor params; ragged params route their layout's owned
        blocks). ``cost_of(p, numel)``: a block's compute cost, for balancing DTensor owners. ``only_cut``: route
        only DTensor blocks that a row-chunk boundary cuts (the rest are computed where they lie)."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        routes: list[BlockRoute] = []
        self.item_routes: list[list[tuple[int, int, int]]] = []
        self.my_range: list[tuple[int, int]] = []
        pending = []  # DTensor blocks whose owners are assigned jointly below
        for p in params:
            ranges = local_ranges(p)
            self.my_range.append(ranges[rank])
            entry = []
            if shard_info(p) is not None:
                rs, spans = ragged_routes(p)
                for r, (s, e) in zip(rs, spans):
                    entry.append((len(routes), s, e))
                    routes.append(r)
            else:
                numel = int(np.prod(full_shape(p)))
                for s, e, pieces, holder in blocks_over_ranges(spec_of(p), numel, ranges):
                    if only_cut and len(pieces) < 2:
                        continue  # whole on one rank: computed there
                    entry.append((len(routes), s, e))
                    pending.append((len(routes), e - s, pieces, holder, cost_of(p, e - s)))
                    routes.append(None)
            self.item_routes.append(entry)
        if pending:
            owners = balanced_owners([c for *_, c in pending], [h for _, _, _, h, _ in pending], world)
            for (ri, numel, pieces, _, _), owner in zip(pending, owners):
                routes[ri] = BlockRoute(numel, owner, pieces)
        self.routes = routes
        self.exchange = OwnerExchange(routes, rank, world, group)

    def local_pieces(self, k: int, flat_local: torch.Tensor) -> dict[int, torch.Tensor]:
        """Param k's local flat tensor cut into its pieces of each block: ``{route index: piece}``."""
        lo, hi = self.my_range[k]
        out = {}
        for ri, s, e in self.item_routes[k]:
            a, b = max(lo, s), min(hi, e)
            if b > a:
                out[ri] = flat_local[a - lo : b - lo]
        return out

    def assemble(self, k: int, pieces: dict[int, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """Param k's local flat result from its pieces of each block (in tensor order)."""
        lo, hi = self.my_range[k]
        parts = [pieces[ri] for ri, s, e in self.item_routes[k] if min(hi, e) > max(lo, s)]
        if not parts:
            return torch.zeros_like(like)
        return torch.cat(parts).to(like.dtype).view(like.shape)
