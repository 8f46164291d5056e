"""Routes for owner-computed blocks: which rank holds which piece of a block, for ragged-sharded params and for
torch FSDP2 ``DTensor`` params sharded on dim 0 (whose row chunks are a ragged layout too)."""

from __future__ import annotations

import math

import torch

from ragged_optim.comm.owner_exchange import BlockRoute
from ragged_optim.sharding.layout import BlockSpec
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


def dtensor_local_ranges(param: torch.Tensor) -> list[tuple[int, int]]:
    """Each rank's flat element range of a DTensor sharded ``Shard(0)`` on a 1-D mesh (torch.chunk rows)."""
    from torch.distributed.tensor import Shard

    mesh = param.device_mesh
    if mesh.ndim != 1 or len(param.placements) != 1 or not isinstance(param.placements[0], Shard):
        raise ValueError(
            f"only 1-D meshes with Shard(0) placement are supported for DTensor params, got {param.placements} "
            f"on a {mesh.ndim}-D mesh; redistribute the param or use ragged_optim.fully_shard"
        )
    if param.placements[0].dim != 0:
        raise ValueError(f"DTensor params must be sharded on dim 0, got Shard({param.placements[0].dim})")
    w = mesh.size()
    d0 = param.shape[0]
    rest = math.prod(param.shape[1:])
    chunk = -(-d0 // w) if d0 else 0
    ranges = []
    for r in range(w):
        a, b = min(r * chunk, d0), min((r + 1) * chunk, d0)
        ranges.append((a * rest, b * rest))
    return ranges


def balanced_owners(costs: list[float], holders: list[int], world_size: int, slack: float = 1.1) -> list[int]:
    """Owners for blocks by greedy largest-first, preferring the rank that holds most of the block while it stays
    within ``slack`` of the balanced load (then no data moves for it)."""
    load = [0.0] * world_size
    target = sum(costs) / max(1, world_size)
    owners = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: -costs[j]):
        h = holders[j]
        if h >= 0 and load[h] + costs[j] <= slack * target + 1e-9:
            r = h
        else:
            r = min(range(world_size), key=lambda k: (load[k], k))
        owners[j] = r
        load[r] += costs[j]
    return owners


def blocks_over_ranges(spec: BlockSpec, numel: int, ranges: list[tuple[int, int]]):
    """Every block of ``spec`` over given per-rank flat ranges: ``(start, end, pieces, holder)`` each, where
    ``holder`` is the rank with the largest piece. Owners are for the caller to assign (jointly over all params,
    with ``balanced_owners``)."""
    out = []
    start = 0
    while start < numel:
        s, e = spec.block_of(start, numel)
        pieces = tuple((r, max(a, s) - s, min(b, e) - s) for r, (a, b) in enumerate(ranges) if min(b, e) > max(a, s))
        holder = max(pieces, key=lambda p: p[2] - p[1])[0] if pieces else -1
        out.append((s, e, pieces, holder))
        start = e
    return out
