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
held whole at a time (one subtree's, for a module whose ``reset_parameters`` reaches into its children). Modules
run children first, then themselves (``nn.Module.apply``'s order: eager construction ends a module's ``__init__``
with its ``reset_parameters``), so with the same seed the result equals building the model normally.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ragged_optim.sharding.sharded_param import full_shape, local_of, shard_info


@torch.no_grad()
def init_weights(model: nn.Module, init_fn=None) -> None:
    """Initialise every param of a sharded (and ``to_empty``-materialised) model in place.

    Modules run their init children first, then the module itself (``nn.Module.apply``'s order, and the order of
    eager construction, where a module's ``__init__`` ends by calling its ``reset_parameters`` after building its
    children; transformers' init applies in this order too). ``init_fn(module)``: the init of one module (default:
    its ``reset_parameters``); it sees the module's own params full-shaped and may touch only those and the module's
    buffers (e.g. transformers' ``model._init_weights``, which also fills a rotary embedding's ``inv_freq``). It runs
    on every module that has params or buffers of its own: buffers are not sharded, and ``to_empty`` leaves them
    uninitialised too. Without ``init_fn``, a module with buffers and no params is reset only when it has a
    ``reset_parameters``; and a module whose ``reset_parameters`` may reach into its children (a block that zeroes
    its output projection) is initialised with its whole subtree on full-shaped tensors (its children's inits,
    then its own), so its writes land, as when built normally: that subtree is held whole for the time. A param
    tied to one that an earlier module initialised keeps that value; the later module's init still runs (on a
    scratch tensor), so the random stream advances as it does when the model is built normally and tied
    afterwards."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"init_weights: model must be an nn.Module, got a {type(model).__name__}")
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"init_weights: init_fn must be a function of one module (or None), got {init_fn!r}")
    _init_module(model, "", init_fn, set())


def _subtree_init(module: nn.Module, init_fn) -> bool:
    """A module whose own ``reset_parameters`` may touch its descendants' params: init the subtree together."""
    if init_fn is not None or not hasattr(module, "reset_parameters"):
        return False
    return any(p is not None for m in module.children() for p in m.parameters())


def _init_module(module: nn.Module, name: str, init_fn, done: set[int]) -> None:
    if _subtree_init(module, init_fn):
        _init_subtree(module, name, done)
        return
    for child_name, child in module.named_children():
        _init_module(child, f"{name}.{child_name}" if name else child_name, init_fn, done)
    own = [(attr, p) for attr, p in module._parameters.items() if p is not None]
    buffers = [(attr, b) for attr, b in module._buffers.items() if b is not None]
    if not own:
        if buffers and (init_fn is not None or hasattr(module, "reset_parameters")):
            _check_not_meta(name, module, buffers)
            (init_fn or (lambda m: m.reset_parameters()))(module)
        return
    init = init_fn if init_fn is not None else _reset_parameters_of(module, name, own)
    _check_not_meta(name, module, own)
    slots = [(module, attr, p) for attr, p in own]
    with _full_scratch_in(slots) as full:
        init(module)
    _keep_local(slots, full, done)


def _init_subtree(root: nn.Module, name: str, done: set[int]) -> None:
    """Every module under ``root`` (itself included, last) inits on full-shaped scratch tensors put in its params'
    places, in ``apply`` order; then this rank keeps its elements of each."""
    modules = []  # post-order: children first
    root.apply(modules.append)
    slots = []
    for m in modules:
        own = [(attr, p) for attr, p in m._parameters.items() if p is not None]
        buffers = [(attr, b) for attr, b in m._buffers.items() if b is not None]
        if own:
            _reset_parameters_of(m, f"{name} ({type(m).__name__})" if name else type(m).__name__, own)
        _check_not_meta(name, m, own + buffers)
        slots += [(m, attr, p) for attr, p in own]
    with _full_scratch_in(slots) as full:
        for m in modules:
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    _keep_local(slots, full, done)


class _full_scratch_in:
    """Put a full-shaped scratch tensor in each ``(module, attr, param)`` slot (one per slot: a tied param's two
    places init separately, as when the model is tied after it is built); restore the params on exit."""

    def __init__(self, slots):
        self.slots = slots

    def __enter__(self) -> list[nn.Parameter]:
        self.full = [_full_scratch(p) for _, _, p in self.slots]
        for (m, attr, _), t in zip(self.slots, self.full):
            m._parameters[attr] = t
        return self.full

    def __exit__(self, *exc) -> None:
        for m, attr, p in self.slots:
            m._parameters[attr] = p


def _keep_local(slots, full, done: set[int]) -> None:
    """This rank's elements of each slot's scratch into its param (the first slot of a tied param wins)."""
    for (_, _, p), t in zip(slots, full):
        if id(p) in done:
            continue  # tied to a param an earlier module initialised
        done.add(id(p))
        info = shard_info(p)
        src = t.detach().reshape(-1)
        if info is not None:
            lo, hi = info.local_range
            local_of(p).copy_(src[lo:hi])
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
    shape = full_shape(p)
    t = torch.empty(math.prod(shape), dtype=p.dtype, device=p.device).view(shape)
    return nn.Parameter(t, requires_grad=p.requires_grad)
