"""`fully_shard`: the call shape of torch.distributed.fsdp.fully_shard, on RaggedShard flat buffers.

Each call makes one unit of the params under ``module`` that no inner call owns. Hooks unshard a unit before its
forward (prefetching the next unit), reshard after it, unshard again before its backward, and reduce-scatter its
flat grad buffer once all of its grads have landed. One root callback at the end of backward finishes what is
left (params that got no grad, async reduce-scatters).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from ragged_optim.sharding.flat_unit import FlatUnit
from ragged_optim.sharding.sharded_param import shard_info

_UNIT_ATTR = "_ragged_unit"


class _Tracker:
    """Per-process state of one forward/backward iteration, shared by all units."""

    def __init__(self):
        self.units: weakref.WeakSet[FlatUnit] = weakref.WeakSet()
        self.depth = 0
        self.pre_forward_order: list[FlatUnit] = []
        self.post_forward_order: list[FlatUnit] = []
        self.recording = True
        self.touched: list[FlatUnit] = []
        self.callback_queued = False


_TRACKER = _Tracker()


def _next_in(order: list, unit):
    for i, u in enumerate(order):
        if u is unit:
            return order[i + 1] if i + 1 < len(order) else None
    return None


class RaggedFSDPModule:
    """Mixed into a module's class by ``fully_shard`` (as torch's FSDPModule is), for the familiar methods."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward accumulates grads locally (no reduce-scatter) until it is set back to True."""
        mods = self.modules() if recurse else [self]
        for m in mods:
            unit = getattr(m, _UNIT_ATTR, None)
            if unit is not None:
                unit.requires_grad_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        mods = self.modules() if recurse else [self]
        for m in mods:
            unit = getattr(m, _UNIT_ATTR, None)
            if unit is not None:
                unit.reshard_after_forward = reshard_after_forward

    def unshard(self) -> None:
        getattr(self, _UNIT_ATTR).wait_unshard()
        getattr(self, _UNIT_ATTR).set_unsharded_attrs()

    def reshard(self) -> None:
        getattr(self, _UNIT_ATTR).reshard()


_CLASS_CACHE: dict[type, type] = {}


def _mix_in(module: nn.Module) -> None:
    cls = type(module)
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"RaggedFSDP{cls.__name__}", (RaggedFSDPModule, cls), {})
    module.__class__ = _CLASS_CACHE[cls]


def _resolve_groups(mesh):
    """(shard group, replicate group or None) from a ProcessGroup, a 1-D mesh, or a 2-D (replicate, shard) mesh."""
    if mesh is None:
        if not dist.is_initialized():
            raise RuntimeError(
                "fully_shard needs torch.distributed: call dist.init_process_group first "
                "(or use ragged_optim.comm.launch.run_on_ranks), or pass mesh=<DeviceMesh or ProcessGroup>"
            )
        return dist.group.WORLD, None
    if hasattr(mesh, "get_group"):
        if mesh.ndim == 1:
            return mesh.get_group(), None
        if mesh.ndim == 2:  # HSDP: shard along the last dim, replicate along the first
            return mesh.get_group(1), mesh.get_group(0)
        raise ValueError(f"fully_shard(mesh=...) takes a 1-D mesh or a 2-D (replicate, shard) mesh, got {mesh.ndim}-D")
    return mesh, None


def _collect_params(module: nn.Module):
    """Params under ``module`` not owned by an inner unit, deduplicated (tied weights), in registration order."""
    params, names, refs, seen = [], [], [], {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is None or shard_info(p) is not None:
                continue
            if id(p) in seen:
                refs[seen[id(p)]].append((mod, attr))
                continue
            seen[id(p)] = len(params)
            params.append(p)
            names.append(f"{mod_name}.{attr}" if mod_name else attr)
            refs.append([(mod, attr)])
    return params, names, refs


def _check_params(module: nn.Module, params, names):
    for p, n in zip(params, names):
        if not p.is_floating_point():
            raise TypeError(f"fully_shard: param {n!r} has dtype {p.dtype}; only floating-point params can be sharded")
        if p.is_meta:
            raise ValueError(f"fully_shard: param {n!r} is on the meta device; materialize it first (to_empty + init)")
    if params:
        d0, t0 = params[0].device, params[0].dtype
        for p, n in zip(params, names):
            if p.device != d0:
                raise ValueError(
                    f"fully_shard: params of one unit must share a device; {names[0]!r} is on {d0} but {n!r} on "
                    f"{p.device}. Move the module with .to(device) first"
                )
            if p.dtype != t0:
                raise ValueError(
                    f"fully_shard: params of one unit must share a dtype; {names[0]!r} is {t0} but {n!r} is "
                    f"{p.dtype}. Cast the module, or shard the odd param's module separately"
                )


def fully_shard(
    module: nn.Module,
    *,
    mesh=None,
    reshard_after_forward: bool = True,
    mp_policy=None,
    block_policy=None,
    comm_policy=None,
):
    """Shard ``module``'s params (those no inner ``fully_shard`` owns) into one RaggedShard unit; returns module.

    ``mesh``: a 1-D DeviceMesh or a ProcessGroup (default: the world), or a 2-D DeviceMesh ``(replicate, shard)``
    for HSDP: params are ragged-sharded over the shard dim and replicated over the other; grads are
    reduce-scattered within the shard group, then all-reduced across replicas (only the local shard's bytes).
    Each call may take its own mesh (e.g. an encoder over 2 ranks per replica, the decoder over 4).
    ``mp_policy``: torch's
    ``MixedPrecisionPolicy`` (param_dtype for compute and all-gather, reduce_dtype for the reduce-scatter; the
    sharded master params keep the module's dtype). ``block_policy``: ``fn(name, param) -> BlockSpec | None``,
    which blocks an optimizer needs whole; our optimizers re-plan this for you when they are constructed.
    ``comm_policy``: a ``CommPolicy`` (e.g. ``QuantizedAllGather("int8")``) for quantized communication.
    Non-contiguous params are accepted (their values are copied into the flat buffer). A module with no params of
    its own makes an empty unit that communicates nothing.
    """
    if getattr(module, _UNIT_ATTR, None) is not None:
        raise ValueError(f"fully_shard was already called on this {type(module).__name__}; call it once per module")
    group, replicate_group = _resolve_groups(mesh)
    params, names, refs = _collect_params(module)
    _check_params(module, params, names)
    unit = FlatUnit(module, params, names, refs, group, mp_policy, comm_policy, replicate_group)
    for p, n in zip(params, names):  # an optimizer built on these old params can then say what happened
        p._ragged_replaced_by = n
    if block_policy is not None:
        specs = {i: s for i, (n, p) in enumerate(zip(names, params)) if (s := block_policy(n, p)) is not None}
        unit.relayout(specs)
    unit.reshard_after_forward = reshard_after_forward
    _reset_iteration_flags(unit)
    unit.on_all_grads_ready = _post_backward
    setattr(module, _UNIT_ATTR, unit)
    _TRACKER.units.add(unit)
    module.register_forward_pre_hook(_pre_forward)
    module.register_forward_hook(_post_forward)
    _mix_in(module)
    return module


def units_of(module: nn.Module) -> list[FlatUnit]:
    """The units under ``module``, outermost last (the order of ``fully_shard`` calls in the usual nesting)."""
    return [u for m in module.modules() if (u := getattr(m, _UNIT_ATTR, None)) is not None][::-1]


def _reset_iteration_flags(unit: FlatUnit):
    unit.backward_started = False
    unit.post_backward_done = False
    unit.grads_ready = 0


def _pre_forward(module, args):
    unit: FlatUnit = getattr(module, _UNIT_ATTR)
    tr = _TRACKER
    unit.is_root = tr.depth == 0
    if unit.is_root:  # the outermost unit of this forward: a new iteration starts
        for u in tr.units:
            u.stale = True
        tr.recording = not tr.pre_forward_order
        tr.touched = []
    tr.depth += 1
    if tr.recording and torch.is_grad_enabled():
        tr.pre_forward_order.append(unit)
    if unit not in tr.touched:
        tr.touched.append(unit)
    _reset_iteration_flags(unit)
    unit.wait_unshard()
    unit.set_unsharded_attrs()
    nxt = _next_in(tr.pre_forward_order, unit)
    if nxt is not None:
        nxt.start_unshard()


def _post_forward(module, args, output):
    unit: FlatUnit = getattr(module, _UNIT_ATTR)
    tr = _TRACKER
    tr.depth -= 1
    if tr.recording and torch.is_grad_enabled():
        tr.post_forward_order.append(unit)
    unit.set_sharded_attrs()
    grad_outputs = [t for t in _tensors(output) if t.requires_grad]
    if torch.is_grad_enabled() and grad_outputs:
        torch.autograd.graph.register_multi_grad_hook(grad_outputs, lambda _g, u=unit: _pre_backward(u), mode="any")
    keep = unit.is_root and torch.is_grad_enabled()  # the root's backward starts right away
    if not keep and (unit.reshard_after_forward or not torch.is_grad_enabled()):
        unit.reshard()
    if tr.depth == 0:
        tr.recording = False
    return output


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from _tensors(getattr(obj, name))


def _pre_backward(unit: FlatUnit):
    if unit.backward_started:
        return
    unit.backward_started = True
    tr = _TRACKER
    if not tr.callback_queued:
        tr.callback_queued = True
        Variable._execution_engine.queue_callback(_final_callback)
    unit.wait_unshard()
    unit.set_sharded_attrs()
    unit.prepare_grads()
    nxt = _next_in(tr.post_forward_order[::-1], unit)
    if nxt is not None and not nxt.backward_started:
        nxt.start_unshard()


def _post_backward(unit: FlatUnit):
    if unit.post_backward_done:
        return
    unit.post_backward_done = True
    unit.start_reduce_grads()
    unit.reshard()


def _final_callback():
    tr = _TRACKER
    tr.callback_queued = False
    for unit in tr.touched:
        if unit.backward_started and not unit.post_backward_done:
            _post_backward(unit)  # some params got no grad this time
        else:
            unit.reshard()
    for unit in tr.touched:
        unit.finish_reduce_grads()
        _reset_iteration_flags(unit)
