"""Full (consolidated) model state dicts for sharded modules: export to, and load from, plain torch."""

from __future__ import annotations

import torch
from torch import nn

from ragged_optim.sharding.sharded_param import shard_info


def get_full_state_dict(model: nn.Module, *, cpu: bool = True) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every sharded param replaced by its full tensor (a collective: one all-gather
    per unit; call it on every rank). The result loads into the unsharded model with ``load_state_dict``."""
    sd = model.state_dict(keep_vars=True)
    gathered: dict[int, list[torch.Tensor]] = {}
    out = {}
    for name, t in sd.items():
        info = shard_info(t)
        if info is not None:
            unit = info.unit
            if id(unit) not in gathered:
                gathered[id(unit)] = unit._gather_master()
            t = gathered[id(unit)][info.index]
        t = t.detach()
        out[name] = t.cpu() if cpu else t
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load a full state dict (e.g. from ``get_full_state_dict`` or an unsharded model) into a sharded model:
    each rank copies its own ranges. No communication."""
    own = model.state_dict(keep_vars=True)
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if strict and (missing or unexpected):
        raise KeyError(
            f"load_full_state_dict: keys do not match the model; missing {missing[:5]}, unexpected {unexpected[:5]}. "
            "Is the checkpoint from another model? Pass strict=False to load the common keys"
        )
    for name, t in own.items():
        if name not in state_dict:
            continue
        src = state_dict[name]
        info = shard_info(t)
        full_shape = info.shape if info is not None else t.shape
        if tuple(src.shape) != tuple(full_shape):
            raise ValueError(
                f"load_full_state_dict: {name!r} has shape {tuple(src.shape)} in the state dict but "
                f"{tuple(full_shape)} in the model; the checkpoint is from a differently shaped model"
            )
        if info is not None:
            lo, hi = info.local_range
            t.copy_(src.reshape(-1)[lo:hi].to(t.dtype))
        else:
            t.copy_(src)
