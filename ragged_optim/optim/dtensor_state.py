"""State of torch FSDP2 (``DTensor``, ``Shard(0)``) params in our optimizers' state dicts, as torch's optimizers
have it: torch's AdamW on FSDP2 params keeps DTensor state, so ``get_optimizer_state_dict`` + ``dcp.save`` write
each rank's rows of one global tensor and ``dcp.load`` reshards them at any world size. Ours keep the state as
local tensors (the step runs on local tensors); without this, DCP took each rank's local tensor for a replicated
one and refused to load it (``Size mismatch between saved torch.Size([12, 72]) and current: torch.Size([14, 72])``)
even at the same world size.

- ``state_dict()``: an entry shaped like the param's local piece (momentum, Adam moments) becomes a DTensor of the
  param's global shape and placements (a view: nothing is copied). AdamW8bit's codes and scales (each rank holds
  the blocks inside its rows and the cut blocks it owns: several ranges) become RaggedDTensors of the full param
  and of its blocks (``fsdp2_state_layout``). Other entries (Shampoo/SOAP band state, keyed by band, each band
  saved by the rank that computes it; step counters) are left as they are.
- ``load_state_dict()``: a DTensor (what ``dcp.load`` filled, or another layout's) becomes this rank's local piece,
  redistributed when its placements differ; a full tensor of the param's global shape (``full_state_dict=True``,
  a plain model's state) is cut to this rank's rows (or ranges).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ragged_optim.optim.base import is_dtensor, local, local_range, process_group
from ragged_optim.sharding import shard_info
from ragged_optim.sharding.ragged_dtensor import ragged_dtensor
from ragged_optim.sharding.state_dict import local_piece

__all__ = ["dtensor_state_from_dcp", "dtensor_state_to_dcp"]


def _fsdp2_params(opt, state_dict: dict) -> list[tuple[Any, torch.Tensor, dict]]:
    """(saved param id, param, its group) of every torch DTensor param of ``opt`` (not ours: ragged params have
    their own hooks), matched by position as torch's loader does; [] when the groups do not line up."""
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list):
        return []
    ids = [i for g in groups if isinstance(g, dict) for i in g.get("params", [])]
    params = [(p, g) for g in opt.param_groups for p in g["params"]]
    if len(ids) != len(params):
        return []  # torch's own check says what is wrong
    return [(i, p, g) for i, (p, g) in zip(ids, params) if is_dtensor(p) and shard_info(p) is None]


def _map_state(opt, state_dict: dict, entry) -> dict:
    """``state_dict`` with each tensor entry of an FSDP2 param's state replaced by ``entry(opt, p, group, key,
    value)`` (new dicts; the optimizer's own state is not touched)."""
    pairs = _fsdp2_params(opt, state_dict)
    if not pairs:
        return state_dict
    state = dict(state_dict["state"])
    for pid, p, group in pairs:
        st = state.get(pid)
        if isinstance(st, dict):
            state[pid] = {
                k: entry(opt, p, group, k, v) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                for k, v in st.items()
            }
    return {**state_dict, "state": state}


def _to_dcp(opt, p, group: dict, key: str, v: torch.Tensor) -> torch.Tensor:
    if isinstance(v, DTensor):
        return v
    if (layout := _layout(opt, p, key, group)) is not None:
        return ragged_dtensor(v, *layout, dist.get_rank(process_group(p)), process_group(p))
    if v.shape == local(p).shape:
        return DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return v


def dtensor_state_to_dcp(opt, state_dict: dict) -> dict:
    """``state_dict`` with the local-piece state of FSDP2 params as DTensors (views of the state)."""
    return _map_state(opt, state_dict, _to_dcp)


def _layout(opt, p, key: str, group: dict):
    """An optimizer's own global layout of a state entry that is not the param's local rows (AdamW8bit's codes
    and scales: ``fsdp2_state_layout``), or None."""
    fn = getattr(opt, "fsdp2_state_layout", None)
    return fn(p, key, group) if fn is not None else None


def _local_rows(full: torch.Tensor, p: DTensor) -> torch.Tensor:
    lo, hi = local_range(p)  # the row chunk torch's Shard(0) gives this rank, as everywhere in this library
    return full.reshape(-1)[lo:hi].view(local(p).shape)


def _from_dcp(opt, p, group: dict, key: str, v: torch.Tensor) -> torch.Tensor:
    if (layout := _layout(opt, p, key, group)) is not None:
        shape, ranges = layout
        if tuple(v.shape) == tuple(shape) or isinstance(v, DTensor):  # else: a rank-local piece, as saved
            return local_piece(v, ranges, dist.get_rank(process_group(p)), shape, ())
        return v
    if isinstance(v, DTensor) and v.shape == p.shape:
        same = v.device_mesh == p.device_mesh and tuple(v.placements) == tuple(p.placements)
        return (v if same else v.redistribute(p.device_mesh, p.placements)).to_local()
    if not isinstance(v, DTensor) and v.shape == p.shape:
        return _local_rows(v, p)
    return v


def dtensor_state_from_dcp(opt, state_dict: Any) -> Any:
    """The inverse for loading: state of FSDP2 params as this rank's local pieces (a collective when a DTensor's
    placements differ from the param's: every rank loads together, as with torch's optimizers)."""
    if not (isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict)):
        return state_dict
    return _map_state(opt, state_dict, _from_dcp)
