"""What a unit says when a param is misused: each message names the param and the fix. Kept here so the unit's
control flow reads as control flow."""

from __future__ import annotations

import torch

_LOW_PRECISION = (
    "for low-precision compute keep the params in fp32 and pass "
    "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
)


def layout_in_use(names) -> str:
    return (
        f"the layout of params {names[:3]} is already in use by an optimizer's state; construct every optimizer "
        "before the first step (or pass block_policy= to fully_shard)"
    )


def still_on_meta(label: str) -> str:
    return (
        f"param {label} is still on the meta device: materialize the sharded model before its first forward, with "
        "model.to_empty(device=...) and then ro.init_weights(model) (or your own init on ro.full_tensor views); see "
        "docs/runtime.md, 'Big models: meta-device init'"
    )


def cast_or_moved(label: str, dtype: torch.dtype, device, laid_dtype: torch.dtype, laid_device) -> str:
    return (
        f"param {label} is {dtype} on {device}, but fully_shard laid it out as {laid_dtype} on {laid_device}: the "
        "module was cast or moved after fully_shard (e.g. .to(torch.bfloat16), .double(), .cuda()). Cast and move "
        f"the module before fully_shard; {_LOW_PRECISION}"
    )


def data_replaced(label: str) -> str:
    return (
        f"param {label} no longer lives in fully_shard's flat buffer: its .data was replaced after fully_shard, and "
        "training would ignore the new tensor. Change params in place (p.copy_(...)) or before fully_shard"
    )


def param_replaced(label: str, module_name: str, attr: str) -> str:
    return (
        f"param {label} was replaced after fully_shard ({module_name}.{attr} is a new object), and training would "
        "silently overwrite it. Copy new values in place (with torch.no_grad(): p.copy_(new)) or assign params "
        "before fully_shard"
    )


def cast_by_apply(label: str, to: torch.dtype, laid_dtype: torch.dtype) -> str:
    return (
        f"the module of param {label} is being cast to {to} after fully_shard, which laid it out as {laid_dtype}: "
        f"nothing was changed. Cast before fully_shard; {_LOW_PRECISION}"
    )


def kept_by_weak_reference(label: str) -> str:
    return (
        f"to_empty: {label} is held by a weak reference, so it could not be kept as the same Parameter object: an "
        "optimizer built before to_empty does not hold the new one (build it after to_empty, from "
        "model.parameters())"
    )


def forward_after_params_freed(unit) -> str:
    return (
        f"fully_shard: {unit.module_name}'s forward ran again inside its backward after some of its params were "
        "freed there (their grads were all taken: a reentrant checkpoint recomputes it later). Use "
        "torch.utils.checkpoint with use_reentrant=False, or set "
        "ragged_optim.sharding.grad_buckets.FREE_PARAMS_IN_BACKWARD = False"
    )
