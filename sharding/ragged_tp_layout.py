"""Where every rank's elements of a tensor-parallel param that ``fully_shard`` ragged-sharded lie in the full tensor.

Under tensor parallel a unit lays out each rank's TP-local block (a box of the global tensor at the TP offsets) and
ragged-shards it over the data-parallel dim, so a rank holds a flat range ``[lo, hi)`` of its box: a list of runs
of the global flat tensor. An optimizer computes each of its blocks (a whole matrix, a band) once in the job, so it
needs every rank's runs, as :class:`~ragged_optim.sharding.dtensor_layout.DTensorLayout` gives them for torch's
DTensors. Another rank's range is not known here (each TP rank's unit is planned on its own TP-local shapes), so
:func:`share_tensor_parallel_runs`, a collective over the joint (dp, tp) mesh, exchanges them once per layout.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist

from ragged_optim.sharding.dtensor_layout import DTensorLayout, Holding, exchange_group
from ragged_optim.sharding.layout import BlockSpec
from ragged_optim.sharding.sharded_param import shard_info

__all__ = ["box_runs", "ragged_tp_layout", "share_tensor_parallel_runs", "tp_local_spec"]

# Per unit, per param index: (the unit's layout the runs were shared for, the param's layout over the joint mesh).
_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def box_runs(shape, offsets, box, lo: int, hi: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Elements ``[lo, hi)`` of the row-major flattening of a box (``box`` sizes at ``offsets``) of a tensor of
    ``shape``, as runs of the tensor's flat order: ``(starts, lengths, local starts)``, local starts counted from
    ``lo``."""
    shape, offsets, box = tuple(shape), tuple(offsets), tuple(box)
    if hi <= lo:
        return (), (), ()
    cut = [d for d in range(len(shape)) if box[d] != shape[d]]
    if not cut:  # the box is the whole tensor
        return (lo,), (hi - lo,), (0,)
    k = cut[-1]  # the last dim the box does not span: each of its rows of dims k.. is one run of the tensor
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    seg = box[k] * strides[k]
    t = torch.arange(lo // seg, (hi - 1) // seg + 1)
    start = torch.full_like(t, offsets[k] * strides[k])
    rest = t.clone()
    for d in reversed(range(k)):
        start += (offsets[d] + rest % box[d]) * strides[d]
        rest = rest // box[d]
    local0 = t * seg
    a = (lo - local0).clamp(min=0)
    b = (hi - local0).clamp(max=seg)
    return tuple((start + a).tolist()), tuple((b - a).tolist()), tuple((local0 + a - lo).tolist())


class RaggedTensorParallelLayout(DTensorLayout):
    """A :class:`DTensorLayout` built from every rank's runs (ranks with the same runs are replicas: one class).
    It never reports one flat range per rank (:meth:`ranges`): these params always take the N-D path."""

    def __init__(self, shape, group, runs: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]) -> None:
        self.shape = tuple(shape)
        self.numel = math.prod(self.shape)
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        by_runs: dict[tuple, list[int]] = {}
        for r, (starts, lens, _) in enumerate(runs):
            by_runs.setdefault((starts, lens), []).append(r)
        self.classes = []
        self.class_of = [0] * self.world
        for ranks in by_runs.values():
            self.classes.append(Holding(tuple(ranks), *runs[ranks[0]]))
            for r in ranks:
                self.class_of[r] = len(self.classes) - 1

    def ranges(self) -> None:
        return None


def share_tensor_parallel_runs(params) -> None:
    """Exchange every rank's runs of the tensor-parallel ragged params among ``params`` (one all_gather per joint
    mesh; a collective: every rank of those meshes calls it with the same params, in the same order). Their
    :func:`ragged_tp_layout` holds until the unit re-plans."""
    by_group: dict[int, tuple] = {}
    for p in params:
        info = shard_info(p)
        if info is None or info.tp is None:
            continue
        group = exchange_group(info.tp.exchange_mesh)
        by_group.setdefault(id(group), (group, []))[1].append(p)
    for group, ps in by_group.values():
        mine = []
        for p in ps:
            info = shard_info(p)
            lo, hi = info.local_range
            mine.append(box_runs(info.tp.shape, info.tp.offsets, info.tp.local_shape, lo, hi))
        every: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        for j, p in enumerate(ps):
            info = shard_info(p)
            layout = RaggedTensorParallelLayout(info.shape, group, [every[r][j] for r in range(len(every))])
            _SHARED.setdefault(info.unit, {})[info.index] = (info.unit.layout, layout)


def ragged_tp_layout(param: torch.Tensor) -> RaggedTensorParallelLayout:
    """Every rank's elements of tensor-parallel ragged param ``param``, as shared by the last
    :func:`share_tensor_parallel_runs` for the unit's current layout."""
    info = shard_info(param)
    held = _SHARED.get(info.unit, {}).get(info.index)
    if held is None or held[0] is not info.unit.layout:
        raise RuntimeError(
            f"param {info.name!r} (in {info.unit.module_name}) is tensor-parallel and ragged-sharded; where the other "
            "ranks hold its elements is shared when an optimizer declares its blocks (a ragged_optim.BlockOptimizer's "
            "constructor, or ragged_optim.declare_blocks), and its unit was re-planned since or never declared. "
            "Build the optimizer after fully_shard, on every rank"
        )
    return held[1]


def tp_local_spec(spec: BlockSpec, shape, offsets, local_shape) -> BlockSpec | None:
    """The blocks to keep whole in a rank's TP-local box (``local_shape`` at ``offsets`` of ``shape``) for an
    optimizer's ``spec`` of the global tensor: a whole matrix's TP-local part whole on one dp rank, bands of g rows
    when the box starts on a band, runs of g when it starts on a run; None (no constraint) otherwise. A guide for
    the planner only: blocks always reach their owner whole, over the joint mesh, whatever this lays out."""
    shape, offsets, local_shape = tuple(shape), tuple(offsets), tuple(local_shape)
    if shape == local_shape:
        return spec
    numel = math.prod(local_shape)
    if numel == 0:
        return None
    if len(shape) == 1:
        return BlockSpec.elements(spec.block, numel) if offsets[0] % spec.block == 0 else None
    rows, cols = shape[-2], shape[-1]
    if spec.row_len != cols:
        return None
    if spec.owner_computed and spec.block == spec.period:  # whole matrices (of a stack, or the whole tensor)
        per = numel if spec.period == math.prod(shape) else local_shape[-2] * local_shape[-1]
        if spec.period not in (math.prod(shape), rows * cols):
            return None
        return BlockSpec(block=per, period=per, owner_computed=True, row_len=local_shape[-1])
    g = spec.block // cols
    if spec.block % cols or spec.period != rows * cols or offsets[-2] % g:
        return None
    return BlockSpec.rows(g, local_shape)
