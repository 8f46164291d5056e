"""Initialising a model that was sharded on the meta device, without ever holding it whole.

    with torch.device("meta"):
        model = Model()
    for block in model.layers:
        ro.fully_shard(block)
    ro.fully_shard(model)
    model.to_empty(device="cpu")   # each rank allocates only its own shards
    ro.init_weights(model)         # each module's init runs on full-shaped params, one module at a time

Every rank runs every module's init with the same random stream, on temporary full-shaped tensors of that
module's own params, and keeps only its own elements: no communication, and at most one module's params are
held whole at a time. Modules are visited in ``model.modules()`` order, the order in which most models construct
(and so initialise) them, so with the same seed the result equals building the model normally.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ragged_optim.sharding.sharded_param import shard_info


@torch.no_grad()
def init_weights(model: nn.Module, init_fn=None) -> None:
    """Initialise every param of a sharded (and ``to_empty``-materialised) model in place.

    ``init_fn(module)``: the init of one module (default: its ``reset_parameters``); it sees the module's own params
    full-shaped and may touch only those and the module's buffers (e.g. transformers' ``model._init_weights``, which
    also fills a rotary embedding's ``inv_freq``). It runs on every module that has params or buffers of its own:
    buffers are not sharded, and ``to_empty`` leaves them uninitialised too. Without ``init_fn``, a module with
    buffers and no params is reset only when it has a ``reset_parameters``. A param tied to one that an earlier
    module initialised keeps that value; the later module's init still runs (on a scratch tensor), so the random
    stream advances as it does when the model is built normally and tied afterwards."""
    done: set[int] = set()
    for name, module in model.named_modules():
        own = [(attr, p) for attr, p in module._parameters.items() if p is not None]
        buffers = [(attr, b) for attr, b in module._buffers.items() if b is not None]
        if not own:
            if buffers and (init_fn is not None or hasattr(module, "reset_parameters")):
                _check_not_meta(name, module, buffers)
                (init_fn or (lambda m: m.reset_parameters()))(module)
            continue
        init = init_fn if init_fn is not None else _reset_parameters_of(module, name, own)
        _check_not_meta(name, module, own)
        full = {attr: _full_scratch(p) for attr, p in own}
        for attr, t in full.items():
            module._parameters[attr] = t
        try:
            init(module)
        finally:
            for attr, p in own:
                module._parameters[attr] = p
        for attr, p in own:
            if id(p) in done:
                continue  # tied to a param an earlier module initialised
            done.add(id(p))
            info = shard_info(p)
            src = full[attr].detach().reshape(-1)
            if info is not None:
                lo, hi = info.local_range
                p.copy_(src[lo:hi])
            else:
                p.copy_(src.view_as(p))


def _check_not_meta(name: str, module: nn.Module, tensors) -> None:
    meta = next((attr for attr, t in tensors if t.is_meta), None)
    if meta is not None:
        raise RuntimeError(
            f"init_weights: {name or type(module).__name__}.{meta} is on the meta device: call "
            "model.to_empty(device=...) first, then init_weights(model)"
        )


def _reset_parameters_of(module: nn.Module, name: str, own):
    fn = getattr(module, "reset_parameters", None)
    if fn is None:
        raise ValueError(
            f"init_weights: module {name or '<root>'} ({type(module).__name__}) has params "
            f"({', '.join(a for a, _ in own)}) but no reset_parameters(); pass init_fn=fn(module) that initialises "
            "a module's own params (e.g. init_fn=model._init_weights for transformers models)"
        )
    return lambda m: fn()


def _full_scratch(p: torch.Tensor) -> nn.Parameter:
    info = shard_info(p)
    shape = info.shape if info is not None else p.shape
    t = torch.empty(math.prod(shape), dtype=p.dtype, device=p.device).view(shape)
    return nn.Parameter(t, requires_grad=p.requires_grad)
