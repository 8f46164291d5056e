"""Params that tensor parallel (torch's ``parallelize_module``) made DTensors, sharded further by ``fully_shard``.

Like torch's 2-D FSDP, a unit holds each rank's TP-local tensor (``p.to_local()``) and ragged-shards that over the
data-parallel dim; the TP dims stay as TP left them. So a sharded param is a DTensor on the mesh of both (the
data-parallel dim plus the TP mesh's dims) with ``RaggedShard()`` on the data-parallel dim and TP's own placements
on the others, and an unsharded param (what the module's forward sees) is TP's DTensor again, on the TP mesh, over
the all-gathered TP-local tensor. :class:`TensorParallelPart` is what both need to know.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial

__all__ = ["TensorParallelPart", "tensor_parallel_part"]


@dataclass(frozen=True, eq=False)
class TensorParallelPart:
    """One TP param's layout around its ragged shard."""

    tp_mesh: DeviceMesh  # the param's mesh under tensor parallel
    tp_placements: tuple  # its placements there (Shard(d), Replicate(); no Partial)
    shape: torch.Size  # the global shape
    stride: tuple[int, ...]  # the global (contiguous) stride
    local_shape: torch.Size  # this rank's TP-local shape: what the unit lays out and ragged-shards
    offsets: tuple[int, ...]  # where this rank's TP-local block starts in the global tensor
    mesh: DeviceMesh  # data-parallel dim + the TP mesh's dims: the sharded param's mesh
    ragged_dim: int  # the data-parallel dim's index in ``mesh``
    #: Every dim of ``fully_shard``'s mesh (HSDP's replicate dim too) + the TP mesh's dims: the ranks an optimizer
    #: block of this param is computed once among.
    exchange_mesh: DeviceMesh | None = None

    @property
    def placements(self) -> tuple:
        """The sharded param's placements on :attr:`mesh`."""
        from ragged_optim.sharding.ragged_dtensor import RaggedShard

        out = list(self.tp_placements)
        out.insert(self.ragged_dim, RaggedShard())
        return tuple(out)

    def local_block(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's TP-local block of a global tensor (a view)."""
        return full[tuple(slice(o, o + n) for o, n in zip(self.offsets, self.local_shape))]

    def unsharded(self, tp_local: torch.Tensor) -> DTensor:
        """TP's DTensor over ``tp_local`` (no copy): what the module's forward sees."""
        return DTensor.from_local(
            tp_local, self.tp_mesh, self.tp_placements, run_check=False, shape=self.shape, stride=self.stride
        )

    def full(self, tp_local: torch.Tensor) -> torch.Tensor:
        """The global tensor from every TP rank's TP-local block (a collective over the TP mesh)."""
        return self.unsharded(tp_local).full_tensor()

    def __eq__(self, other) -> bool:  # (frozen dataclass equality would compare meshes element by element)
        return isinstance(other, TensorParallelPart) and (
            self.tp_mesh == other.tp_mesh
            and self.tp_placements == other.tp_placements
            and self.shape == other.shape
            and self.mesh == other.mesh
        )

    __hash__ = object.__hash__


_JOINT_MESHES: dict = {}


def _joint_mesh(shard_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel dim and the TP mesh's dims as one mesh, built once per pair (every TP param of a model
    shares it, rather than one object per param)."""
    key = (shard_mesh, tp_mesh)
    if key not in _JOINT_MESHES:
        _JOINT_MESHES[key] = DeviceMesh._concatenate([shard_mesh, tp_mesh])
    return _JOINT_MESHES[key]


def tensor_parallel_part(
    param: DTensor, name: str, shard_mesh: DeviceMesh | None, full_mesh: DeviceMesh | None = None
) -> TensorParallelPart:
    """The layout of TP param ``param`` (named ``name``) under a unit sharded over ``shard_mesh`` (the shard dim of
    ``full_mesh``, fully_shard's mesh: HSDP's has a replicate dim before it); a clear error for
    layouts that cannot be sharded further (partial values, a TP mesh that shares a dim with the shard mesh, a
    shard mesh that is not a DeviceMesh of the same root)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(param.placements)
    if any(isinstance(pl, Partial) for pl in placements):
        raise ValueError(
            f"fully_shard: param {name!r} has placements {placements} on {param.device_mesh}: a Partial param holds "
            "unreduced values, which cannot be sharded. Redistribute it to Replicate() or Shard(d) first"
        )
    tp_mesh = param.device_mesh
    if not isinstance(shard_mesh, DeviceMesh):
        raise ValueError(
            f"fully_shard: param {name!r} is a tensor-parallel DTensor (placements {placements} on {tp_mesh}); to "
            "shard it over the data-parallel ranks, pass mesh=<the data-parallel dim of the same DeviceMesh>, e.g. "
            "mesh = init_device_mesh('cpu', (dp, tp), mesh_dim_names=('dp', 'tp')); parallelize_module(block, "
            "mesh['tp'], plan); fully_shard(block, mesh=mesh['dp'])"
        )
    tp_names, dp_names = tp_mesh.mesh_dim_names or (), shard_mesh.mesh_dim_names or ()
    same_root = tp_mesh._get_root_mesh() == shard_mesh._get_root_mesh()
    if not (tp_names and dp_names and same_root) or set(tp_names) & set(dp_names):
        raise ValueError(
            f"fully_shard: param {name!r} is a tensor-parallel DTensor on {tp_mesh}, which is not another dim of the "
            f"fully_shard mesh {shard_mesh}'s DeviceMesh (it must be: ragged_optim shards the TP-local tensors over "
            "the data-parallel dim). Slice both from one named mesh: mesh = init_device_mesh(..., (dp, tp), "
            "mesh_dim_names=('dp', 'tp')); parallelize_module(m, mesh['tp'], plan); fully_shard(m, mesh=mesh['dp'])"
        )
    mesh = _joint_mesh(shard_mesh, tp_mesh)
    shape = torch.Size(param.shape)
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    local_shape, offsets = compute_local_shape_and_global_offset(shape, tp_mesh, placements)
    if torch.Size(local_shape) != param.to_local().shape:
        raise ValueError(
            f"fully_shard: param {name!r}'s TP-local tensor has shape {tuple(param.to_local().shape)}, but its "
            f"placements {placements} on {tp_mesh} give {tuple(local_shape)} for shape {tuple(shape)} here"
        )
    full_mesh = shard_mesh if full_mesh is None else full_mesh
    exchange = mesh if full_mesh.ndim == 1 else _joint_mesh(full_mesh, tp_mesh)
    return TensorParallelPart(
        tp_mesh, placements, shape, stride, torch.Size(local_shape), tuple(offsets), mesh, 0, exchange
    )
