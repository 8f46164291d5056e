"""A ragged-sharded tensor as torch's distributed checkpoint (DCP) sees it: full shape, rectangular chunks per rank.

Rank k holds elements ``[lo_k, hi_k)`` of the row-major flattening of a tensor of shape ``shape``. Such a range is
not one rectangle, but it is a short list of them: a partial last-dim row, whole rows of the next dim up, ... up to
whole slabs of dim 0, then the same going down (at most ``2 * ndim - 1`` boxes; for a matrix: a partial first
row, whole rows, a partial last row). :class:`RaggedDTensor` describes each box to DCP as one chunk
(``__create_write_items__`` / ``__create_chunk_list__`` / ``__get_tensor_shard__``) whose data is a view of the flat
local piece, so ``dcp.save`` writes exactly the rank's elements and ``dcp.load`` writes straight into them. DCP's
own overlap logic reshards between any two layouts (ours at any world size, FSDP2's ``Shard(0)``, a plain tensor).

It is a ``DTensor`` subclass so that torch's state-dict helpers treat it as a distributed tensor:
``get_model_state_dict(..., full_state_dict=True)`` calls ``redistribute(placements=[Replicate()])``, which we
answer with one all-gather, and ``_distribute_state_dict`` (``set_*_state_dict(full_state_dict=True)``) calls
``distribute_tensor(full, mesh, placements)``. Its placement, :class:`RaggedShard`, derives from ``Replicate`` for
that one call only: ``distribute_tensor`` then hands every rank the full value and our load hooks cut the rank's
range out of it. No DTensor op rule ever sees a RaggedDTensor: every aten op other than detach/alias/clone/copy
to another device or dtype is refused with a message (the local data is a ragged piece, not what any rule expects).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ragged_optim.comm.collectives import all_gather_flat, serves_cuda

__all__ = ["RaggedDTensor", "RaggedShard", "flat_range_boxes", "normalize_ranges", "ragged_dtensor"]

Box = tuple[tuple[int, ...], tuple[int, ...], int, int]  # (offsets, sizes, flat start, flat end)


def flat_range_boxes(shape, lo: int, hi: int) -> list[Box]:
    """The rectangles that make up elements ``[lo, hi)`` of a row-major tensor of ``shape``, in element order:
    ``(offsets, sizes, start, end)`` with ``[start, end)`` the flat elements of each box."""
    shape = tuple(int(d) for d in shape)
    if hi <= lo:
        return []
    if not shape:
        return [((), (), lo, hi)]
    if len(shape) == 1:
        return [((lo,), (hi - lo,), lo, hi)]
    inner = math.prod(shape[1:])
    out: list[Box] = []

    def rows_of(row: int, a: int, b: int) -> None:  # part [a, b) of row ``row`` (inside one row)
        for off, size, s, e in flat_range_boxes(shape[1:], a, b):
            out.append(((row, *off), (1, *size), row * inner + s, row * inner + e))

    if lo % inner:
        row = lo // inner
        end = min(hi, (row + 1) * inner)
        rows_of(row, lo - row * inner, end - row * inner)
        lo = end
    whole = hi // inner - lo // inner if lo < hi else 0
    if whole > 0:
        r0 = lo // inner
        out.append(((r0, *([0] * (len(shape) - 1))), (whole, *shape[1:]), lo, lo + whole * inner))
        lo += whole * inner
    if lo < hi:
        row = lo // inner
        rows_of(row, 0, hi - row * inner)
    return out


class RaggedShard(Replicate):
    """The placement of a :class:`RaggedDTensor` (one per mesh dim: the shard group). See the module doc for why it
    derives from ``Replicate``; the ranges live on the tensor, not here."""

    def __repr__(self) -> str:
        return "RaggedShard()"

    __str__ = __repr__


_MESHES: dict = {}


def adopt_mesh(mesh: DeviceMesh) -> None:
    """Use the caller's own 1-D ``mesh`` (a dim of their named mesh) for the sharded params of its group, as FSDP2
    puts its DTensors on the mesh it was given: ``p.device_mesh == mesh["dp"]`` holds, and norms of these params
    combine with TP's params' of the same root. The first mesh seen for a group stays (tensors already made hold
    it)."""
    if mesh.ndim == 1:
        _MESHES.setdefault(mesh.get_group(), mesh)


def mesh_of(group) -> DeviceMesh:
    """A 1-D DeviceMesh over ``group`` (cached per group; building one is cheap but not free)."""
    group = group if group is not None else dist.group.WORLD
    if group not in _MESHES:
        device = "cuda" if serves_cuda(group) and torch.cuda.is_available() else "cpu"
        _MESHES[group] = DeviceMesh.from_group(group, device)
    return _MESHES[group]


Pieces = tuple[tuple[int, int], ...]  # one rank's flat element ranges, in the order its local data holds them


def normalize_ranges(ranges) -> tuple[Pieces, ...]:
    """Every rank's ranges as pieces: a rank's entry is one ``(lo, hi)`` or a list of them."""
    out = []
    for r in ranges:
        r = tuple(r)
        if len(r) == 2 and not isinstance(r[0], tuple | list):
            out.append(((int(r[0]), int(r[1])),) if r[1] > r[0] else ())  # (idempotent: empty ranges dropped)
        else:
            out.append(tuple((int(a), int(b)) for a, b in r if b > a))
    return tuple(out)


class RaggedDTensor(DTensor):
    """A tensor of full shape ``shape`` of which this rank holds the flat elements ``ranges[rank]`` (``_local``, a
    1-D view of the flat shard; several ranges, concatenated, when a rank holds pieces, as AdamW8bit's state of an
    FSDP2 param does). Build it with :func:`ragged_dtensor`."""

    _ragged_ranges: tuple[Pieces, ...]  # over the flattening of the TP-local tensor when ``_ragged_tp`` is set
    _ragged_rank: int
    _ragged_tp = None  # a TensorParallelPart: the TP layout the ragged shard sits inside (tensor_parallel.py)

    def data_ptr(self) -> int:
        """0, as for any DTensor wrapper built over a local tensor at offset 0: the wrapper holds no storage. (Ours
        sit at the flat shard's offsets, which made torch report a fake nonzero address, and DCP's async stager
        then tried to copy the wrapper's storage instead of its local tensor.)"""
        return 0

    @property
    def _ragged_group(self):
        """The process group, from the mesh: not an attribute of its own, which copies (DCP's async stager deep-copies
        the tensor's ``__dict__``) could not take (``cannot pickle ProcessGroup``)."""
        tp = self._ragged_tp
        return self.device_mesh.get_group() if tp is None else self.device_mesh.get_group(tp.ragged_dim)

    @property
    def _ragged_shape(self) -> torch.Size:
        """The shape the ranges cut: the tensor's own, or its TP-local block's under tensor parallel."""
        return self.shape if self._ragged_tp is None else self._ragged_tp.local_shape

    # ----- DCP's chunk protocol ---------------------------------------------------------------------------
    def _boxes(self) -> list[Box]:
        """This rank's boxes, with ``[start, end)`` their elements in the local data."""
        shape, tp = self._ragged_shape, self._ragged_tp
        shift = (0,) * len(shape) if tp is None else tp.offsets  # a TP-local block's place in the global tensor
        if math.prod(shape) == 0:  # no elements: rank 0 still records the (empty) tensor, shape and all
            return [(tuple(shift), tuple(shape), 0, 0)] if self._ragged_rank == 0 else []
        out, pos = [], 0
        for lo, hi in self._ragged_ranges[self._ragged_rank]:
            for off, size, s, e in flat_range_boxes(shape, lo, hi):
                out.append((tuple(o + d for o, d in zip(off, shift)), size, pos + s - lo, pos + e - lo))
            pos += hi - lo
        return out

    def __create_write_items__(self, fqn: str, obj):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        props = TensorProperties.create_from_tensor(self._local_tensor)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(off)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size)),
                    properties=props,
                    size=self.shape,
                ),
            )
            for off, size, _, _ in self._boxes()
        ]

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _, _ in self._boxes()]

    def __get_tensor_shard__(self, index):
        want = tuple(index.offset) if index.offset is not None else None
        for off, size, s, e in self._boxes():
            if want is None or tuple(off) == want:
                return self._local_tensor[s:e].view(size)
        raise ValueError(f"{index.fqn}: this rank holds no chunk at offset {want}")

    # ----- the full value ---------------------------------------------------------------------------------
    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:
        """The full tensor on every rank (a collective on the shard group: one all-gather; under tensor parallel,
        then TP's own gather over the TP dims)."""
        tp = self._ragged_tp
        shard = self._gather_ragged()
        return shard if tp is None else tp.full(shard)

    def _gather_ragged(self) -> torch.Tensor:
        """The tensor the ranges cut (the whole one, or the TP-local block), from every rank of the shard group."""
        group, shape = self._ragged_group, self._ragged_shape
        world = len(self._ragged_ranges)
        local = self._local_tensor.reshape(-1)
        width = max((sum(hi - lo for lo, hi in pieces) for pieces in self._ragged_ranges), default=0)
        if world == 1 and local.numel() == math.prod(shape):
            return local.clone().view(shape)
        buf = torch.zeros(width, dtype=local.dtype, device=local.device)
        buf[: local.numel()] = local
        out = torch.empty(world * width, dtype=local.dtype, device=local.device)
        all_gather_flat(out, buf, group=group)
        full = torch.empty(math.prod(shape), dtype=local.dtype, device=local.device)
        for r, pieces in enumerate(self._ragged_ranges):
            pos = r * width
            for lo, hi in pieces:
                full[lo:hi] = out[pos : pos + hi - lo]
                pos += hi - lo
        return full.view(shape)

    def redistribute(self, device_mesh=None, placements=None, *, async_op=False, **_kw):
        """To ``[Replicate()]`` (what ``get_*_state_dict(full_state_dict=True)`` asks for) or to FSDP2's
        ``[Shard(0)]``, on this tensor's mesh: one all-gather, then each rank keeps its rows."""
        from torch.distributed.tensor import Shard

        mesh = device_mesh if device_mesh is not None else self.device_mesh
        ok = placements is not None and len(placements) == mesh.ndim and mesh == self.device_mesh
        if ok and all(type(pl) is Replicate for pl in placements):
            return DTensor.from_local(self.full_tensor(), mesh, list(placements), run_check=False)
        if not (ok and mesh.ndim == 1 and placements[0] == Shard(0)):
            raise NotImplementedError(
                f"a ragged-sharded tensor redistributes to [Replicate()] or [Shard(0)] on its own mesh, not "
                f"{placements}; call .full_tensor() and distribute the full value"
            )
        full = self.full_tensor()
        world, rank = mesh.size(), mesh.get_local_rank()
        rows = list(torch.chunk(full, world, dim=0)) if full.dim() else [full]
        mine = rows[rank] if rank < len(rows) else full[:0]
        return DTensor.from_local(
            mine.contiguous(), mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )

    def to_local(self, *, grad_placements=None) -> torch.Tensor:
        """This rank's flat piece (elements ``ranges[rank]`` of the flattened tensor), aliasing the flat shard."""
        return self._local_tensor

    @property
    def ragged_pieces(self) -> Pieces:
        """This rank's flat element ranges, in the order of its local data."""
        return self._ragged_ranges[self._ragged_rank]

    @property
    def data(self) -> RaggedDTensor:
        return self.detach()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """``p.data = t`` points this tensor at ``t``'s elements for this rank (another RaggedDTensor of this
        shape: its local tensor; a full-shape tensor: its range). torch's own ``set_data`` would change only the
        wrapper and keep the old local tensor, silently; a sharded param's unit then sees that the param no
        longer lives in its flat buffer and says so."""
        if tuple(value.shape) != tuple(self.shape):
            raise RuntimeError(
                f"p.data = a tensor of shape {tuple(value.shape)} on a ragged-sharded tensor of shape "
                f"{tuple(self.shape)}: the shapes must agree (change values in place: p.copy_(t))"
            )
        self._local_tensor = value._local_tensor if isinstance(value, RaggedDTensor) else self.local_part_of(value)

    def local_part_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's elements of ``full`` (a tensor of this one's full shape), in the order of the local data."""
        if self._ragged_tp is not None:
            full = self._ragged_tp.local_block(full)
        flat = full.reshape(-1)
        pieces = [flat[lo:hi] for lo, hi in self.ragged_pieces]
        if not pieces:
            return flat[:0]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    # ----- ops -------------------------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from ragged_optim.sharding.ragged_ops import dispatch

        return dispatch(func, args, kwargs or {})

    def _rewrap(self, local: torch.Tensor) -> RaggedDTensor:
        return build_ragged(
            local, self.shape, self._ragged_ranges, self._ragged_rank, self._ragged_group, tp=self._ragged_tp
        )

    def __repr__(self) -> str:
        held = " + ".join(f"[{lo}, {hi})" for lo, hi in self.ragged_pieces) or "none"
        tp = self._ragged_tp
        of = "" if tp is None else f" of the TP-local {tuple(tp.local_shape)} block at {tp.offsets}"
        return (
            f"RaggedDTensor(shape={tuple(self.shape)}, dtype={self.dtype}, elements {held} of "
            f"{math.prod(self._ragged_shape)}{of} on rank {self._ragged_rank} of {len(self._ragged_ranges)})"
        )

    __str__ = __repr__

    def __deepcopy__(self, memo):
        return self._rewrap(self._local_tensor.clone())

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "a ragged-sharded state-dict tensor cannot be pickled (torch.save): save state dicts with "
            "torch.distributed.checkpoint (dcp.save), or get full tensors with "
            "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)) / "
            "ragged_optim.get_full_state_dict(model) for a model, ragged_optim.get_full_optimizer_state_dict(model, "
            "opt) for an optimizer's state (ragged_optim.save_checkpoint saves both)"
        )


def build_ragged(local, shape, ranges, rank, group, tp=None) -> RaggedDTensor:
    """A RaggedDTensor over ``local`` itself (no detach: a view keeps its base alive); see ragged_dtensor. ``tp``: a
    TensorParallelPart when ``ranges`` cut the TP-local block of a tensor-parallel param (the shard group is then
    ``tp.mesh``'s data-parallel dim)."""
    shape = torch.Size(shape)
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    meta = TensorMeta(shape, stride, local.dtype)
    if tp is None:
        spec = DTensorSpec(mesh_of(group), (RaggedShard(),), tensor_meta=meta)
    else:
        spec = DTensorSpec(tp.mesh, tp.placements, tensor_meta=meta)
    out = RaggedDTensor(local, spec, requires_grad=False)
    out._ragged_ranges = normalize_ranges(ranges)
    out._ragged_rank = int(rank)
    if tp is not None:
        out._ragged_tp = tp
    return out


def ragged_dtensor(local: torch.Tensor, shape, ranges, rank: int, group) -> RaggedDTensor:
    """Wrap ``local`` (this rank's flat elements ``ranges[rank]`` of a tensor of ``shape``; not copied) for DCP.
    ``ranges`` lists every rank's ``(lo, hi)``, or list of them (its pieces, concatenated in ``local``), in
    ``group``'s rank order."""
    want = sum(hi - lo for lo, hi in normalize_ranges(ranges)[rank])
    local = local.detach()
    if local.numel() != want:
        raise ValueError(f"ragged_dtensor: the local piece has {local.numel()} elements, {ranges[rank]} wants {want}")
    return build_ragged(local.reshape(-1), shape, ranges, rank, group)


def _register_foreach_support() -> None:
    """torch's optimizers and ``clip_grad_norm_`` take their foreach (multi-tensor) paths only for tensor types in
    these lists, which DTensor adds itself to; without this, torch.optim.AdamW on our params ran its per-param loop,
    every op a Python dispatch: 1.9x FSDP2's optimizer step on bench20m."""
    import torch.optim.optimizer as optimizer
    import torch.utils._foreach_utils as foreach_utils

    for types in (optimizer._foreach_supported_types, foreach_utils._foreach_supported_types):
        if RaggedDTensor not in types:
            types.append(RaggedDTensor)


_register_foreach_support()


def is_ragged_dtensor(t) -> bool:
    return isinstance(t, RaggedDTensor)
