"""Where the cut (and owner-computed) blocks of one process group's params are computed, and the exchanges that
gather them to their owners and scatter the results back."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ragged_optim.comm.owner_exchange import BlockRoute, OwnerExchange
from ragged_optim.sharding.dtensor_layout import dtensor_layout
from ragged_optim.sharding.layout import BlockSpec
from ragged_optim.sharding.owner_routes import (
    blocks_over_layout,
    held_alone,
    layout_route,
    owners_by_cost,
    ragged_routes,
)
from ragged_optim.sharding.sharded_param import full_shape, shard_info


class BlockRouting:
    """Where the cut (and owner-computed) blocks of one process group's params are computed.

    Owners are fixed by the whole param set an optimizer declared (not by which params have grads in a step), so
    per-block state stays on one rank. Ragged params take their layout's owners (balanced at the declaration by the
    optimizer's ``block_cost``); DTensor blocks get owners from the same balancer here (largest cost first,
    preferring the rank that holds most of it), whole blocks too with ``balance_whole``.

    ``routed[id(p)]``: ``(start, end, route)`` of each block of ``p`` that moves between ranks."""

    def __init__(
        self, members: list[tuple[Tensor, BlockSpec]], group, cost: Callable, balance_whole: bool = False
    ) -> None:
        self.group, self.rank, self.world = group, dist.get_rank(group), dist.get_world_size(group)
        self.routed: dict[int, list[tuple[int, int, BlockRoute | None]]] = {}
        pending = []
        for p, spec in members:
            entry: list[tuple[int, int, BlockRoute | None]] = []
            if _laid_out_by_its_unit(p):
                routes, spans = ragged_routes(p)
                entry = [(s, e, r) for r, (s, e) in zip(routes, spans)]
            else:
                numel = max(1, int(torch.Size(full_shape(p)).numel()))
                layout = dtensor_layout(p)
                for s, e, parts, holder in blocks_over_layout(spec, numel, layout):
                    if spec.owner_computed or balance_whole or not held_alone(parts, layout):
                        pending.append((entry, len(entry), cost(p, spec, e - s), holder, parts, layout))
                        entry.append((s, e, None))
            self.routed[id(p)] = entry
        if pending:
            owners = owners_by_cost([x[2] for x in pending], [x[3] for x in pending], self.world)
            for (entry, j, _, _, parts, layout), owner in zip(pending, owners):
                s, e, _ = entry[j]
                entry[j] = (s, e, layout_route(e - s, owner, parts, layout))
        # A block its owner holds whole, alone, moves no data: the owner computes it in place, as a local block (no
        # copy into a gather buffer, no result kept for a scatter). Routes are global, so every rank drops the same.
        for p, _ in members:
            self.routed[id(p)] = [(s, e, r) for s, e, r in self.routed[id(p)] if not _stays_with_owner(r)]
        self._exchanges: dict[tuple, tuple] = {}

    def exchange(self, params: list[Tensor], n_inputs: int) -> tuple[list[list[int]], OwnerExchange, OwnerExchange]:
        """For the params of one step: each one's route indices, the gather exchange (every input's routes, one
        after the other) and the scatter exchange."""
        key = (tuple(id(p) for p in params), n_inputs)
        if key not in self._exchanges:
            routes: list[BlockRoute] = []
            idx = []
            for p in params:
                idx.append(list(range(len(routes), len(routes) + len(self.routed[id(p)]))))
                routes.extend(r for _, _, r in self.routed[id(p)])
            self._exchanges[key] = (
                idx,
                OwnerExchange(routes * n_inputs, self.rank, self.world, self.group),
                OwnerExchange(routes, self.rank, self.world, self.group),
            )
        return self._exchanges[key]


def _laid_out_by_its_unit(p: Tensor) -> bool:
    """A ragged-sharded param whose unit alone lays it out (one range per rank); a tensor-parallel ragged param's
    runs, like a DTensor's, come from its DTensor layout."""
    info = shard_info(p)
    return info is not None and info.tp is None


def _stays_with_owner(route: BlockRoute) -> bool:
    targets = route.pieces if route.targets is None else route.targets
    return len(targets) == 1 and targets[0][0] == route.owner
