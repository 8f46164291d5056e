"""State dicts of ragged-sharded modules and their optimizers, in the form torch's distributed checkpoint speaks.

``model.state_dict()`` of a ``fully_shard`` model holds, under each param's original name, a
:class:`~ragged_optim.sharding.ragged_dtensor.RaggedDTensor`: the full shape, this rank's piece as rectangular
chunks, data aliasing the flat shard. ``model.load_state_dict`` takes those, full tensors (a plain model's state
dict, ``full_state_dict=True``) or any torch DTensor (FSDP2's), checks every key and shape of the whole module tree
before it writes anything, and copies each rank's range into the flat shard. Optimizers get the same treatment
(our optimizers convert in their own ``state_dict``, by their declared state schema; hooks do it on any other
``torch.optim.Optimizer`` that holds ragged-sharded params, from its first ``step`` or ``ro.load_checkpoint``, by
the default schema of :mod:`~ragged_optim.sharding.state_schema`): state shaped like the param's local piece
(``exp_avg``, ``momentum_buffer``) becomes a full-shape RaggedDTensor. See docs/checkpoint.md.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ragged_optim.sharding.ragged_dtensor import RaggedDTensor, build_ragged, normalize_ranges, ragged_dtensor
from ragged_optim.sharding.sharded_param import ShardInfo, local_of, shard_info
from ragged_optim.sharding.state_schema import Elem, default_kind

__all__ = [
    "elem_local_piece",
    "local_piece",
    "get_full_state_dict",
    "install_optimizer_hooks",
    "load_full_state_dict",
    "loading_strict",
    "optimizer_state_from_dcp",
    "optimizer_state_to_dcp",
    "register_state_dict_hooks",
    "sharded_dtensor",
]


# ---------------------------------------------------------------------------------------------------------------
# one tensor
# ---------------------------------------------------------------------------------------------------------------


def _ranges(info: ShardInfo) -> list[tuple[int, int]]:
    layout = info.unit.layout
    return [layout.local_range(r, info.index) for r in range(layout.world_size)]


def sharded_dtensor(local: torch.Tensor, info: ShardInfo) -> RaggedDTensor:
    """``local`` (laid out like the sharded param of ``info``: one value per local element) as a RaggedDTensor of
    the param's full shape."""
    if info.tp is None:
        return ragged_dtensor(local, info.shape, _ranges(info), info.unit.rank, info.unit.group)
    return build_ragged(local.detach().reshape(-1), info.shape, _ranges(info), info.unit.rank, info.unit.group, info.tp)


def _full_value(v: torch.Tensor) -> torch.Tensor:
    """The full value of a state-dict entry: a RaggedDTensor or torch DTensor is gathered (a collective on its
    group; every rank loads the same keys in the same order), a replicated DTensor read locally."""
    if isinstance(v, RaggedDTensor):
        return v.full_tensor()
    if hasattr(v, "placements") and hasattr(v, "to_local"):
        if all(p.is_replicate() for p in v.placements):
            return v.to_local()
        return v.full_tensor()
    return v


def local_piece(v: torch.Tensor, ranges, rank: int, full_shape, local_shape, tp=None) -> torch.Tensor:
    """This rank's piece of state-dict value ``v`` for a tensor laid out by ``ranges`` with ``full_shape`` (``tp``:
    its TensorParallelPart, whose TP-local block the ranges cut)."""
    pieces = normalize_ranges(ranges)
    same = isinstance(v, RaggedDTensor) and v._ragged_ranges == pieces and v._ragged_tp == tp
    if same and tuple(v.shape) == tuple(full_shape):
        return v.to_local()  # same layout: no communication
    full = _full_value(v)
    if tuple(full.shape) != tuple(full_shape) and tuple(full.shape) == tuple(local_shape):
        return full  # a rank-local piece (a per-rank state dict of the same layout)
    if tp is not None:
        full = tp.local_block(full)
    flat = full.reshape(-1)
    if len(pieces[rank]) == 1:
        lo, hi = pieces[rank][0]
        return flat[lo:hi]
    return torch.cat([flat[lo:hi] for lo, hi in pieces[rank]]) if pieces[rank] else flat[:0]


# ---------------------------------------------------------------------------------------------------------------
# module hooks
# ---------------------------------------------------------------------------------------------------------------


def _own_params(module: nn.Module):
    """(name, param, info) for the ragged params of units made by ``fully_shard(module)`` itself, every name of a
    tied param."""
    for name, p in module.named_parameters(remove_duplicate=False):
        info = shard_info(p)
        if info is not None and any(m is module for m in info.unit.modules):
            yield name, p, info


def _to_dcp(module, state_dict, prefix, _local_metadata):
    for name, p, info in _own_params(module):
        key = prefix + name
        if key in state_dict:
            state_dict[key] = sharded_dtensor(local_of(p).detach(), info)


def _expected(module: nn.Module, prefix: str) -> dict[str, tuple]:
    """Every key ``module.state_dict(prefix=prefix)`` has, with its full shape (None: not a tensor)."""
    sd = module.state_dict(prefix=prefix, keep_vars=True)
    return {k: (tuple(v.shape) if isinstance(v, torch.Tensor) else None) for k, v in sd.items()}


_STRICT: contextvars.ContextVar[bool | None] = contextvars.ContextVar("ragged_load_strict", default=None)


@contextlib.contextmanager
def loading_strict(strict: bool):
    """The ``strict`` of the ``load_state_dict`` call in progress on a sharded module (its hooks get True)."""
    token = _STRICT.set(bool(strict))
    try:
        yield
    finally:
        _STRICT.reset(token)


def check_state_dict(module: nn.Module, state_dict: dict, prefix: str, strict: bool) -> None:
    """Raise before anything is written when ``state_dict`` does not fit ``module`` (keys when ``strict``, shapes
    always). The shapes are the full ones: a ragged-sharded param takes its full tensor or a RaggedDTensor/DTensor of
    its full shape. ``strict=False`` leaves missing and unexpected keys to torch, which returns them as lists."""
    want = _expected(module, prefix)
    # torch's set_model_state_dict(full_state_dict=True) fills keys the caller left out with the params themselves
    own = {id(p) for p in module.parameters() if shard_info(p) is not None}
    bad = []
    for k, shape in want.items():
        if k not in state_dict:
            continue
        v = state_dict[k]
        if id(v) in own:
            continue
        if shape is not None and isinstance(v, torch.Tensor) and tuple(v.shape) != shape:
            hint = ""
            if v.dim() == 1 and len(shape) != 1:
                hint = " (a flat rank-local piece? state dicts of ragged-sharded models hold full-shape tensors)"
            bad.append(f"{k!r} has shape {tuple(v.shape)} in the state dict but {shape} in the model{hint}")
    if strict:
        missing = [k for k in want if k not in state_dict]
        unexpected = [k for k in state_dict if k.startswith(prefix) and k not in want]
        if missing:
            bad.append(f"missing keys {missing[:6]}{' ...' if len(missing) > 6 else ''}")
        if unexpected:
            bad.append(f"unexpected keys {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}")
    if bad:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}: nothing was loaded: " + "; ".join(bad)
        )


def _from_dcp(module, state_dict, prefix, local_metadata, strict, _missing, _unexpected, _errors):
    assign = bool(local_metadata.get("assign_to_params_buffers"))
    checked = getattr(state_dict, "_ragged_checked", None)  # the outermost sharded module checks its whole tree
    if checked is None or not prefix.startswith(checked):
        # the hook's strict is always True (see loading_strict); an unsharded parent's call: strict, all or nothing
        check_state_dict(module, state_dict, prefix, strict if (called := _STRICT.get()) is None else called)
        try:
            state_dict._ragged_checked = prefix
        except AttributeError:  # a plain dict: each sharded module checks its own tree
            pass
    for name, p, info in _own_params(module):
        key = prefix + name
        if key in state_dict and state_dict[key] is p:  # see check_state_dict: keeps its value
            state_dict[key] = p.detach()
        elif key in state_dict and isinstance(state_dict[key], torch.Tensor):
            if assign and info.unit.device.type == "meta":
                _materialize_for(info.unit, state_dict[key])
            piece = local_piece(state_dict[key], _ranges(info), info.unit.rank, info.shape, local_of(p).shape, info.tp)
            piece = piece.to(p.dtype) if piece.is_floating_point() else piece
            if assign:  # the values go into the flat buffer, and torch's loader re-assigns the param itself
                with torch.no_grad():
                    local_of(p).copy_(piece.reshape(local_of(p).shape))
                state_dict[key] = p
            else:
                state_dict[key] = sharded_dtensor(piece, info)  # full shape, as torch's loader checks; copied locally


def _materialize_for(unit, value: torch.Tensor) -> None:
    """``load_state_dict(assign=True)`` into a model sharded on the meta device (accelerate's FSDP2 loading: shard
    on meta, then assign the real values): the unit gets real shards on the values' device first, as ``to_empty``
    would give it. Params keep their objects; only their data moves into the flat buffer."""
    device = value.device if not isinstance(value, DTensor) else value.to_local().device
    if device.type != "meta":
        unit.apply_to_shard(lambda t: torch.empty_like(t, device=device))


def register_state_dict_hooks(module: nn.Module) -> None:
    """Make ``module.state_dict()`` / ``load_state_dict`` speak DCP for the units ``fully_shard(module)`` made; also
    install (once per process) the hook that gives optimizers of ragged params the same state dicts."""
    module.register_state_dict_post_hook(_to_dcp)
    module.register_load_state_dict_pre_hook(_from_dcp)
    _install_optimizer_hook()


# ---------------------------------------------------------------------------------------------------------------
# optimizers
# ---------------------------------------------------------------------------------------------------------------


def _params_of(opt) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _local_shape(p: torch.Tensor) -> tuple:
    """The shape of a ragged param's local piece (the param itself, or a DTensor's local tensor)."""
    return tuple(p.to_local().shape) if hasattr(p, "to_local") else tuple(p.shape)


def optimizer_state_to_dcp(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``opt.state_dict()`` with the element-wise state of ragged params as RaggedDTensors (full shapes); new dicts,
    the optimizer's own state is not touched. Idempotent. For optimizers without a state schema (torch's): the
    entries :func:`~ragged_optim.sharding.state_schema.default_kind` takes for :class:`Elem` are converted, every
    other entry is left as it is. (Our optimizers declare their schema and convert their own state.)"""
    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    new_state = dict(state_dict["state"])
    for pid, p in zip(ids, _params_of(opt)):
        info = shard_info(p)
        st = new_state.get(pid)
        if info is None or not st:
            continue
        out = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and not isinstance(v, RaggedDTensor) and v.dim() > 0:
                if isinstance(default_kind(k, v, _local_shape(p), info.shape), Elem):
                    v = sharded_dtensor(v, info)
            out[k] = v
        new_state[pid] = out
    return {**state_dict, "state": new_state}


def elem_local_piece(v: Any, info: ShardInfo, local_shape) -> Any:
    """This rank's piece of an element-wise state entry ``v`` of the ragged param of ``info``: a RaggedDTensor, a
    torch DTensor or a full tensor (of the param's full shape) is cut to this rank's elements; a rank-local piece
    passes as it is."""
    if isinstance(v, torch.Tensor) and (hasattr(v, "placements") or tuple(v.shape) == tuple(info.shape)):
        return local_piece(v, _ranges(info), info.unit.rank, info.shape, local_shape, info.tp)
    return v


def optimizer_state_from_dcp(opt: torch.optim.Optimizer, state_dict: Any) -> Any:
    """The inverse for loading (optimizers without a state schema): entries of ragged params that
    :func:`default_kind` takes for :class:`Elem` (RaggedDTensors, torch DTensors and full tensors) become this rank's
    local pieces; rank-local tensors and anything else pass unchanged for the optimizer's own checks to judge."""
    if not (isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict)):
        return state_dict
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_groups, list):
        return state_dict
    ids = [i for g in saved_groups for i in g.get("params", [])]
    params = _params_of(opt)
    if len(ids) != len(params):
        return state_dict  # torch's own group-size check says what is wrong
    new_state = dict(state_dict["state"])
    for pid, p in zip(ids, params):
        info = shard_info(p)
        st = new_state.get(pid)
        if info is None or not isinstance(st, dict):
            continue
        local = _local_shape(p)
        out = {}
        for k, v in st.items():
            if isinstance(default_kind(k, v, local, info.shape), Elem):
                v = elem_local_piece(v, info, local)
                local_elems = isinstance(v, torch.Tensor) and v.dim() >= 1 and tuple(v.shape) == local
                if local_elems and not isinstance(v, RaggedDTensor) and not getattr(opt, "keeps_local_state", False):
                    v = sharded_dtensor(v, info)  # torch's optimizers keep state like their params: full-shape
            out[k] = v
        new_state[pid] = out
    return {**state_dict, "state": new_state}


def _opt_post_hook(opt, state_dict):
    return optimizer_state_to_dcp(opt, state_dict)


def _opt_pre_hook(opt, state_dict):
    return optimizer_state_from_dcp(opt, state_dict)


def install_optimizer_hooks(opt: torch.optim.Optimizer) -> None:
    """State-dict hooks on ``opt`` (once) if it holds ragged params: see the module doc. Called at an optimizer's
    first step and by ``ro.load_checkpoint``, which gives an optimizer state before any step (without them the
    state dict read right after a load held flat pieces)."""
    if getattr(opt, "converts_own_state_dict", False):  # ours: a declared state schema, read by its state_dict
        return
    if opt.__dict__.get("_ragged_sd_hooks") or not any(shard_info(p) is not None for p in _params_of(opt)):
        return
    opt.register_state_dict_post_hook(_opt_post_hook)
    opt.register_load_state_dict_pre_hook(_opt_pre_hook)
    opt._ragged_sd_hooks = True
    _localize_state(opt)


def _localize_state(opt: torch.optim.Optimizer) -> None:
    """Cut state that a torch optimizer's ``load_state_dict`` took before these hooks existed (full tensors or
    RaggedDTensors, kept as given) to this rank's pieces, which its step computes on. Our own state passes as is."""
    params = _params_of(opt)
    held = {i: opt.state[p] for i, p in enumerate(params) if shard_info(p) is not None and opt.state.get(p)}
    if not held:
        return
    groups, i = [], 0
    for g in opt.param_groups:
        groups.append({**g, "params": list(range(i, i + len(g["params"])))})
        i += len(g["params"])
    for i, st in optimizer_state_from_dcp(opt, {"state": held, "param_groups": groups})["state"].items():
        opt.state[params[i]] = st


def _before_step(opt, _args, _kwargs):
    """Global optimizer step pre-hook: the first step of an optimizer holding ragged params installs its hooks
    (torch's get/set_optimizer_state_dict run a step before they touch the state)."""
    if opt.__dict__.get("_ragged_sd_hooks"):
        return
    n = sum(len(g["params"]) for g in opt.param_groups)
    if opt.__dict__.get("_ragged_sd_seen") == n:
        return
    opt._ragged_sd_seen = n
    install_optimizer_hooks(opt)


_HOOK = []


def _install_optimizer_hook() -> None:
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOK.append(register_optimizer_step_pre_hook(_before_step))


# ---------------------------------------------------------------------------------------------------------------
# full state dicts
# ---------------------------------------------------------------------------------------------------------------


def get_full_state_dict(model: nn.Module, *, cpu: bool = True) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every sharded param replaced by its full tensor (a collective: one all-gather
    per param; call it on every rank). The result loads into the unsharded model with ``load_state_dict``."""
    if not isinstance(cpu, bool):
        raise ValueError(f"get_full_state_dict(cpu={cpu!r}): takes True or False")
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_full_state_dict: model must be an nn.Module, got a {type(model).__name__}")
    out = {}
    for name, t in model.state_dict().items():
        if isinstance(t, torch.Tensor):
            t = t.full_tensor() if isinstance(t, DTensor) else t.detach()  # (ours, and an FSDP2 model's)
            t = t.cpu() if cpu else t
        out[name] = t
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load a full state dict (e.g. from ``get_full_state_dict`` or an unsharded model) into a sharded model:
    each rank copies its own ranges. No communication. Every key and shape is checked before anything is
    written."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"load_full_state_dict: state_dict must be a mapping of names to tensors (e.g. from get_full_state_dict), "
            f"got {type(state_dict).__name__}"
        )
    own = {k: v for k, v in model.state_dict().items()}
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    # RuntimeError, as torch's load_state_dict (a KeyError printed its message with escaped quotes)
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"load_full_state_dict: keys do not match the model; missing {missing[:5]}, unexpected {unexpected[:5]}. "
            "Is the checkpoint from another model? Pass strict=False to load the common keys"
        )
    for name, t in own.items():
        if name in state_dict and isinstance(t, torch.Tensor) and not isinstance(state_dict[name], torch.Tensor):
            raise TypeError(f"load_full_state_dict: {name!r} is a {type(state_dict[name]).__name__}, not a tensor")
        if name in state_dict and isinstance(t, torch.Tensor) and tuple(state_dict[name].shape) != tuple(t.shape):
            raise ValueError(
                f"load_full_state_dict: {name!r} has shape {tuple(state_dict[name].shape)} in the state dict but "
                f"{tuple(t.shape)} in the model; the checkpoint is from a differently shaped model"
            )
    model.load_state_dict({k: v for k, v in state_dict.items() if k in own}, strict=strict)
