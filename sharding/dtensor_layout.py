"""Where every rank's elements of a torch ``DTensor`` param lie in the full tensor, for any mix of ``Shard(d)``,
``_StridedShard`` and ``Replicate`` placements on a mesh of any dims (FSDP2's ``Shard(0)``, FSDP2 + TP, HSDP + TP).

A DTensor's local tensor is the full tensor indexed dim by dim with an increasing index set (the torch.chunk pieces
DTensor's placements cut, in their order), so a rank's elements, in its local flat order, are increasing in the full
tensor's flat order: its elements of any flat range ``[s, e)`` are one contiguous slice of its local flat tensor.
Ranks whose mesh coordinates differ only on ``Replicate`` dims hold the same elements (a *class*); the classes tile
the tensor. The exchange group of a param on an N-D mesh is the whole mesh, flattened, so that each optimizer block
is computed once in the job, by an owner balanced over every rank.
"""

from __future__ import annotations

import bisect
import math
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ragged_optim.sharding.sharded_param import shard_info


@dataclass(frozen=True)
class Holding:
    """The elements one class of ranks holds: runs ``[starts[j], starts[j] + lens[j])`` of the full flat tensor, at
    local flat offsets ``lstarts[j]`` (increasing, disjoint, not adjacent)."""

    ranks: tuple[int, ...]  # exchange-group ranks holding these elements (replicas of each other)
    starts: tuple[int, ...]
    lens: tuple[int, ...]
    lstarts: tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.lstarts[-1] + self.lens[-1] if self.starts else 0

    def count_below(self, x: int) -> int:
        """How many of these elements have a full flat index below ``x``."""
        j = bisect.bisect_right(self.starts, x) - 1
        if j < 0:
            return 0
        return self.lstarts[j] + min(x - self.starts[j], self.lens[j])

    def slice_of(self, s: int, e: int) -> tuple[int, int]:
        """The local flat slice ``[a, b)`` holding this class's elements of the full flat range ``[s, e)``."""
        return self.count_below(s), self.count_below(e)

    def runs_in(self, s: int, e: int) -> list[tuple[int, int]]:
        """This class's elements of ``[s, e)`` as ``[lo, hi)`` runs relative to ``s``, in order."""
        out = []
        j = max(0, bisect.bisect_right(self.starts, s) - 1)
        while j < len(self.starts) and self.starts[j] < e:
            lo, hi = max(s, self.starts[j]), min(e, self.starts[j] + self.lens[j])
            if hi > lo:
                out.append((lo - s, hi - s))
            j += 1
        return out


class DTensorLayout:
    """Every rank's elements of one DTensor param (see the module doc). ``group``: the exchange group (the mesh's
    own group for a 1-D mesh, the flattened mesh otherwise); ``rank``, ``world``: this process in it; ``classes``:
    the holdings; ``class_of[r]``: the class of group rank ``r``."""

    def __init__(self, param: torch.Tensor) -> None:
        mesh = param.device_mesh
        self.shape = tuple(param.shape)
        self.numel = math.prod(self.shape)
        self.group = exchange_group(mesh)
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        coords = _group_coordinates(mesh, self.group)
        placements = tuple(param.placements)
        keep = [i for i, pl in enumerate(placements) if not pl.is_replicate()]
        by_key: dict[tuple, list[int]] = {}
        for r, c in enumerate(coords):
            by_key.setdefault(tuple(c[i] for i in keep), []).append(r)
        self.classes: list[Holding] = []
        self.class_of = [0] * self.world
        for ranks in by_key.values():
            sets = _index_sets(self.shape, mesh, placements, coords[ranks[0]])
            self.classes.append(Holding(tuple(ranks), *_runs(self.shape, sets)))
            for r in ranks:
                self.class_of[r] = len(self.classes) - 1

    def holding(self, rank: int | None = None) -> Holding:
        return self.classes[self.class_of[self.rank if rank is None else rank]]

    def ranges(self) -> list[tuple[int, int]] | None:
        """Every rank's flat range ``[lo, hi)`` when each rank alone holds one contiguous range (FSDP2's ``Shard(0)``
        on a 1-D mesh: its row chunks), else None."""
        out = []
        for r in range(self.world):
            h = self.holding(r)
            if len(h.ranks) > 1 or len(h.starts) > 1:
                return None
            out.append((h.starts[0], h.starts[0] + h.lens[0]) if h.starts else (0, 0))
        return out

    def local_of_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's elements of a full-shape tensor, flat, in local order."""
        flat = full.reshape(-1)
        h = self.holding()
        if not h.starts:
            return flat[:0]
        return torch.cat([flat[s : s + n] for s, n in zip(h.starts, h.lens)])


def check_placements(param: torch.Tensor, label: str) -> None:
    """Refuse placements no optimizer step can take: ``Partial`` (a pending reduction: the values are not the param's
    yet) and anything that is not a Shard, _StridedShard or Replicate."""
    for i, pl in enumerate(param.placements):
        if pl.is_partial():
            raise ValueError(
                f"{label} is a DTensor with placements {tuple(param.placements)}: Partial on mesh dim {i} means its "
                "local values are summands of the param, not pieces of it. Reduce it first "
                "(param.redistribute(mesh, [Replicate() if p.is_partial() else p for p in placements])), or keep "
                "Partial params out of the optimizer"
            )
        if not (_is_shard(pl) or pl.is_replicate()):
            raise ValueError(
                f"{label} is a DTensor with placements {tuple(param.placements)}; mesh dim {i} holds {pl!r}, which "
                "ragged_optim's optimizers cannot place. Use Shard(d), _StridedShard (FSDP2 + TP) or Replicate"
            )


def _is_shard(pl) -> bool:
    """``Shard(d)`` or ``_StridedShard`` (which is not a ``Shard``, and whose ``is_shard()`` is False)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return pl.is_shard() or isinstance(pl, _StridedShard)


_GROUPS: dict[tuple[int, ...], object] = {}


def exchange_group(mesh):
    """The process group of a mesh's ranks, all of them: its own group for a 1-D mesh, the world when it spans the
    world, else the flattened mesh's (created once per set of ranks: a collective on the first call)."""
    if mesh.ndim == 1:
        return mesh.get_group()
    ranks = tuple(sorted(mesh.mesh.flatten().tolist()))
    if len(ranks) == dist.get_world_size():
        return dist.group.WORLD
    if ranks not in _GROUPS:
        _GROUPS[ranks] = mesh._flatten().get_group()
    return _GROUPS[ranks]


def _group_coordinates(mesh, group) -> list[tuple[int, ...]]:
    """The mesh coordinates of each rank of ``group``."""
    grid = mesh.mesh
    out = []
    for r in range(dist.get_world_size(group)):
        g = dist.get_global_rank(group, r) if group is not dist.group.WORLD else r
        hit = (grid == g).nonzero()
        out.append(tuple(int(x) for x in hit[0].tolist()))
    return out


def _index_sets(shape, mesh, placements, coord) -> list[torch.Tensor]:
    """Per tensor dim, the indices a rank at mesh coordinate ``coord`` holds: DTensor's own splits (each placement
    cuts its dim in mesh-dim order, as ``distribute_tensor`` does), applied to an index vector."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    sets = [torch.arange(n) for n in shape]
    for i, pl in enumerate(placements):
        if not _is_shard(pl):
            continue
        d = pl.dim if pl.dim >= 0 else pl.dim + len(shape)
        cut = _StridedShard(0, split_factor=pl.split_factor) if isinstance(pl, _StridedShard) else Shard(0)
        pieces, _ = cut._split_tensor(sets[d], mesh.size(i), with_padding=False)
        sets[d] = pieces[coord[i]] if coord[i] < len(pieces) else sets[d][:0]
    return sets


def _runs(shape, sets: list[torch.Tensor]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The maximal contiguous runs of the full flat tensor that index sets ``sets`` select: starts, lengths and
    local starts."""
    if not shape:
        return (0,), (1,), (0,)
    if any(len(s) == 0 for s in sets):
        return (), (), ()
    full = [len(s) == n and bool((s == torch.arange(n)).all()) for s, n in zip(sets, shape)]
    if all(full):
        return (0,), (math.prod(shape),), (0,)
    k = max(d for d, f in enumerate(full) if not f)
    inner = math.prod(shape[k + 1 :])
    s = sets[k]
    brk = torch.nonzero(s[1:] != s[:-1] + 1).flatten() + 1
    seg_start = torch.cat([torch.zeros(1, dtype=torch.long), brk])
    seg_end = torch.cat([brk, torch.tensor([len(s)])])
    a, m = s[seg_start], seg_end - seg_start
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    outer = torch.zeros(1, dtype=torch.long)
    for d in range(k):
        outer = (outer[:, None] + sets[d][None, :] * strides[d]).reshape(-1)
    starts = (outer[:, None] + (a * inner)[None, :]).reshape(-1)
    lens = (m * inner).expand(len(outer), -1).reshape(-1)
    ends = starts + lens
    if len(starts) > 1:  # runs that meet (a segment ending a row, the next starting the next one): one run
        new = torch.cat([torch.ones(1, dtype=torch.bool), starts[1:] != ends[:-1]])
        ids = torch.cumsum(new.long(), 0) - 1
        starts = starts[new]
        lens = torch.zeros(len(starts), dtype=torch.long).index_add_(0, ids, lens)
    lstarts = torch.cumsum(lens, 0) - lens
    return tuple(starts.tolist()), tuple(lens.tolist()), tuple(lstarts.tolist())


_LAYOUTS: dict[int, tuple] = {}


def dtensor_layout(param: torch.Tensor) -> DTensorLayout:
    """The layout of a DTensor param, cached per param object (dropped with it) and placements; of a tensor-parallel
    ragged-sharded param, the one its unit shared (:mod:`ragged_optim.sharding.ragged_tp_layout`)."""
    info = shard_info(param)
    if info is not None:
        if info.tp is None:
            raise ValueError("dtensor_layout: a ragged-sharded param's layout is its unit's")
        from ragged_optim.sharding.ragged_tp_layout import ragged_tp_layout  # (that module builds on this one)

        return ragged_tp_layout(param)
    key = (tuple(param.placements), id(param.device_mesh), tuple(param.shape))
    hit = _LAYOUTS.get(id(param))
    if hit is not None and hit[0] == key and hit[1]() is param:
        return hit[2]
    layout = DTensorLayout(param)
    pid = id(param)
    try:
        ref = weakref.ref(param, lambda _: _LAYOUTS.pop(pid, None))
    except TypeError:  # (a tensor type without weak references: not cached)
        return layout
    _LAYOUTS[pid] = (key, ref, layout)
    return layout
