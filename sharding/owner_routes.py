"""Routes for owner-computed blocks: which rank holds which piece of a block, for ragged-sharded params and for
torch ``DTensor`` params of any placements (:mod:`ragged_optim.sharding.dtensor_layout`)."""

from __future__ import annotations

import torch

from ragged_optim.comm.owner_exchange import BlockRoute, Runs
from ragged_optim.sharding.dtensor_layout import DTensorLayout
from ragged_optim.sharding.layout import BlockSpec
from ragged_optim.sharding.owner_balance import balance_owners
from ragged_optim.sharding.sharded_param import shard_info


def ragged_routes(param: torch.Tensor) -> tuple[list[BlockRoute], list[tuple[int, int]]]:
    """Routes of every owner-computed or split block of a ragged-sharded param, and each block's tensor-local
    ``(start, end)``."""
    info = shard_info(param)
    layout, i = info.unit.layout, info.index
    routes, spans = [], []
    for ob in layout.owned_blocks[i]:
        pieces = []
        for r in layout.ranks_of(i, ob.start, ob.end):
            lo, hi = layout.local_range(r, i)
            a, b = max(lo, ob.start), min(hi, ob.end)
            if b > a:
                pieces.append((r, a - ob.start, b - ob.start))
        routes.append(BlockRoute(ob.end - ob.start, ob.owner, tuple(pieces)))
        spans.append((ob.start, ob.end))
    return routes, spans


def blocks_over_ranges(spec: BlockSpec, numel: int, ranges: list[tuple[int, int]]):
    """Every block of ``spec`` over given per-rank flat ranges: ``(start, end, pieces, holder)`` each, where
    ``holder`` is the rank with the largest piece. Owners are for the caller to assign (jointly over all params,
    with ``owner_balance.balance_owners``)."""
    out = []
    start = 0
    while start < numel:
        s, e = spec.block_of(start, numel)
        pieces = tuple((r, max(a, s) - s, min(b, e) - s) for r, (a, b) in enumerate(ranges) if min(b, e) > max(a, s))
        holder = max(pieces, key=lambda p: p[2] - p[1])[0] if pieces else -1
        out.append((s, e, pieces, holder))
        start = e
    return out


def owners_by_cost(costs: list[float], holders: list[int], world_size: int) -> list[int]:
    """Owners of DTensor params' routed blocks, balanced by cost over every rank of the exchange group: the one call
    site of the balancer for them (:func:`~ragged_optim.sharding.owner_balance.balance_owners`)."""
    return balance_owners(costs, range(world_size), holders)


def blocks_over_layout(spec: BlockSpec, numel: int, layout: DTensorLayout):
    """Every block of ``spec`` over a DTensor layout: ``(start, end, parts, holder)`` each, where ``parts`` lists
    ``(class index, block-local runs)`` for each class of ranks holding elements of it and ``holder`` is a rank of
    the class that holds most of it (-1: none)."""
    out = []
    start = 0
    while start < numel:
        s, e = spec.block_of(start, numel)
        parts, best, holder = [], 0, -1
        for ci, h in enumerate(layout.classes):
            a, b = h.slice_of(s, e)
            if b > a:
                parts.append((ci, h.runs_in(s, e)))
                if b - a > best:
                    best, holder = b - a, h.ranks[0]
        out.append((s, e, parts, holder))
        start = e
    return out


def held_alone(parts, layout: DTensorLayout) -> bool:
    """Whether one rank, and no replica of it, holds a whole block (it is computed where it lies)."""
    return len(parts) == 1 and len(layout.classes[parts[0][0]].ranks) == 1


def layout_route(numel: int, owner: int, parts, layout: DTensorLayout) -> BlockRoute:
    """The route of a block of a DTensor layout to ``owner``: each class's elements come from one of its ranks (the
    owner when it is one of them), the result goes back to every rank of each class (replicas included)."""
    pieces, targets, replicated = [], [], False
    for ci, runs in parts:
        ranks = layout.classes[ci].ranks
        where = runs[0] if len(runs) == 1 else (Runs.of(runs),)
        pieces.append((owner if owner in ranks else ranks[0], *where))
        targets.extend((r, *where) for r in ranks)
        replicated |= len(ranks) > 1
    key = lambda piece: piece[0]
    return BlockRoute(
        numel, owner, tuple(sorted(pieces, key=key)), tuple(sorted(targets, key=key)) if replicated else None
    )
