"""What ``load_state_dict`` checks of a plain (not resharded) optimizer state dict before it changes anything, and
the per-param state kinds the checkpoint code reads: both need only the optimizer and its declared schema."""

from __future__ import annotations

from typing import Any

import torch

from ragged_optim.optim.base import full_shape, local
from ragged_optim.optim.blocks import BlockOptimizer
from ragged_optim.optim.state_schema import declared_schema
from ragged_optim.sharding.state_schema import Elem, StateKind


def declared_kinds(opt, p: torch.Tensor, group: dict) -> dict[str, StateKind]:
    """The state kinds ``opt`` declares for ``p`` (a BlockOptimizer's ``state_schema``; none for a torch one)."""
    return declared_schema(opt, p, group) if isinstance(opt, BlockOptimizer) else {}


def group_starts(opt) -> list[int]:
    """The index of each param group's first param in the state dict's numbering."""
    out, k = [], 0
    for g in opt.param_groups:
        out.append(k)
        k += len(g["params"])
    return out


def check_optimizer_state_dict(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Raise a ValueError naming the param when ``state_dict`` (for ``opt.load_state_dict``) was saved for other
    params: element-wise state whose size differs from the param's local piece (another model, or the same model
    at another world size or layout). torch itself checks only the group sizes."""
    groups = state_dict.get("param_groups", [])
    saved_sizes = [len(g["params"]) for g in groups]
    sizes = [len(g["params"]) for g in opt.param_groups]
    if saved_sizes != sizes:
        raise ValueError(
            f"{type(opt).__name__}.load_state_dict: the state dict has param groups of sizes {saved_sizes}, the "
            f"optimizer {sizes}: it was saved for another model or other param groups"
        )
    ids = [i for g in groups for i in g["params"]]
    starts = group_starts(opt)
    for gi, g in enumerate(opt.param_groups):
        for i, p in enumerate(g["params"]):
            st = state_dict.get("state", {}).get(ids[starts[gi] + i])
            here = local(p).numel()  # (an FSDP2 param's: its local rows)
            declared = declared_kinds(opt, p, g)
            for key, v in (st or {}).items():
                # element-wise state (declared so, or an undeclared tensor: our optimizers' state always is one
                # of the two); per-block and replicated entries are the optimizer's own to check
                kind = declared.get(key, Elem())
                if not isinstance(v, torch.Tensor) or v.dim() == 0 or not isinstance(kind, Elem):
                    continue
                if v.numel() != here:
                    names = g.get("param_names")
                    named = f" ({names[i]!r})" if names else ""
                    raise ValueError(
                        f"{type(opt).__name__}.load_state_dict: state {key!r} of param_groups[{gi}]['params'][{i}]"
                        f"{named} has {v.numel()} elements but the param has {here} here (full shape "
                        f"{tuple(full_shape(p))}): the state dict is from another model, world size or layout. Use "
                        "ragged_optim.checkpoint.save_checkpoint/load_checkpoint to move state across world sizes"
                    )
