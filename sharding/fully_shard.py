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
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_map_only

from ragged_optim.sharding.comm_policy import CommPolicy
from ragged_optim.sharding.flat_unit import FlatUnit
from ragged_optim.sharding.sharded_param import shard_info
from ragged_optim.sharding.state_dict import register_state_dict_hooks

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
        self.synced: set[int] = set()  # ids of the units checked against their sharded params this forward


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
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"set_reshard_after_forward(reshard_after_forward={reshard_after_forward!r}): takes True or False"
            )
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
        groups = dist.group.WORLD, None
    elif isinstance(mesh, DeviceMesh):
        if mesh.ndim == 1:
            groups = mesh.get_group(), None
        elif mesh.ndim == 2:  # HSDP: shard along the last dim, replicate along the first
            groups = mesh.get_group(1), mesh.get_group(0)
        else:
            raise ValueError(
                f"fully_shard(mesh=...) takes a 1-D mesh or a 2-D (replicate, shard) mesh, got {mesh.ndim}-D"
            )
    elif isinstance(mesh, dist.ProcessGroup):
        groups = mesh, None
    elif type(mesh) is int and mesh == dist.GroupMember.NON_GROUP_MEMBER:  # what new_group gives non-members
        raise ValueError(_NOT_A_MEMBER)
    else:
        raise TypeError(
            f"fully_shard(mesh={mesh!r}): mesh takes a DeviceMesh (1-D, or 2-D (replicate, shard) for HSDP), a "
            f"ProcessGroup, or None (the default group); got a {type(mesh).__name__}. For a mesh over all ranks: "
            "torch.distributed.device_mesh.init_device_mesh('cpu' or 'cuda', (world_size,))"
        )
    if any(g is not None and dist.get_rank(g) < 0 for g in groups):
        raise ValueError(_NOT_A_MEMBER)
    return groups


_NOT_A_MEMBER = (
    f"fully_shard(mesh=...): this rank is not a member of the given process group (new_group returns "
    f"{dist.GroupMember.NON_GROUP_MEMBER} on the ranks it leaves out). Call fully_shard for that module only on "
    "the group's ranks, or pass a group or DeviceMesh that contains this rank"
)


def _check_args(module, reshard_after_forward, mp_policy, block_policy, comm_policy):
    """Type checks that need no process group, so a wrong argument fails here rather than deep in a hook."""
    if isinstance(module, list | tuple):
        raise TypeError(
            f"fully_shard(module=...) got a {type(module).__name__} of modules; ragged_optim makes one unit per "
            "module: call fully_shard on each module (for m in modules: fully_shard(m)), or on one nn.Module "
            "whose forward runs them"
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard(module=...) takes an nn.Module, got a {type(module).__name__}")
    _check_reshard_after_forward(reshard_after_forward)
    if mp_policy is not None:
        if not (hasattr(mp_policy, "param_dtype") and hasattr(mp_policy, "reduce_dtype")):
            raise TypeError(
                f"fully_shard(mp_policy={mp_policy!r}): mp_policy takes a torch.distributed.fsdp.MixedPrecisionPolicy"
                ", e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), or None"
            )
        for field in ("param_dtype", "reduce_dtype"):
            d = getattr(mp_policy, field)
            if d is not None and not (isinstance(d, torch.dtype) and d.is_floating_point):
                raise TypeError(
                    f"fully_shard: mp_policy.{field} must be a floating-point torch.dtype or None, got {d!r}"
                )
    if block_policy is not None and not callable(block_policy):
        raise TypeError(
            f"fully_shard(block_policy={block_policy!r}): block_policy takes fn(name, param) -> BlockSpec | None"
        )
    if comm_policy is not None and not isinstance(comm_policy, CommPolicy):
        raise TypeError(
            f"fully_shard(comm_policy={comm_policy!r}): comm_policy takes a CommPolicy, e.g. "
            "QuantizedAllGather('int8') or CommPolicy(param_all_gather='int8', grad_reduce='bf16'), or None"
        )


def _check_reshard_after_forward(value):
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int):
        what = "an int (torch's resharding to a smaller group) is not supported"
    else:
        what = f"got a {type(value).__name__}"
    raise ValueError(
        f"fully_shard(reshard_after_forward={value!r}): {what}; reshard_after_forward "
        "takes True (free the gathered params after forward, gather again for backward), False (keep them until "
        "backward) or None (torch's default; here the same as True: the root unit always keeps its params for "
        "backward)"
    )


def _collect_params(module: nn.Module):
    """Params under ``module`` not owned by an inner unit, deduplicated (tied weights), in registration order."""
    params, names, refs, seen = [], [], [], {}
    inside = {id(m) for m in module.modules()}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            if (info := shard_info(p)) is not None:
                if id(info.unit.module) not in inside:  # an enclosing module was sharded first
                    name = f"{mod_name}.{attr}" if mod_name else attr
                    raise ValueError(
                        f"fully_shard: param {name!r} of this "
                        f"{type(module).__name__} already belongs to the unit of an enclosing "
                        f"{info.unit.module_name} (fully_shard was called on it first). Call fully_shard on inner "
                        "modules first and on the root last, as with torch's FSDP2: "
                        "for block in model.layers: fully_shard(block); then fully_shard(model)"
                    )
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
    reshard_after_forward: bool | None = True,
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
    sharded master params keep the module's dtype; as in FSDP2, floating-point forward inputs are cast to
    param_dtype unless ``cast_forward_inputs=False``, and outputs to ``output_dtype`` when it is set).
    ``block_policy``: ``fn(name, param) -> BlockSpec | None``, which blocks an optimizer needs whole; our
    optimizers re-plan this for you when they are constructed.
    ``comm_policy``: a ``CommPolicy`` (e.g. ``QuantizedAllGather("int8")``) for quantized communication.
    ``reshard_after_forward``: True, False, or None (torch's default: True for inner units, and the root keeps
    its params for backward; our root always does, so None and True behave the same). ``requires_grad_`` on a
    sharded param takes effect at the next forward; cast or move the module before fully_shard (use mp_policy for
    low-precision compute). Non-contiguous params are accepted (their values are copied into the flat buffer). A
    module with no params of its own makes an empty unit that communicates nothing.
    """
    _check_args(module, reshard_after_forward, mp_policy, block_policy, comm_policy)
    if getattr(module, _UNIT_ATTR, None) is not None:
        raise ValueError(f"fully_shard was already called on this {type(module).__name__}; call it once per module")
    params, names, refs = _collect_params(module)
    # Hooks run around forward: a ModuleList or ModuleDict has none, so its submodules' own forward would see the
    # sharded params. (Other modules without forward are left alone: tests and optimizer-only uses set grads by hand
    # or call unshard().) An empty unit, every param already in an inner unit, is harmless.
    if params and isinstance(module, nn.ModuleList | nn.ModuleDict):
        raise TypeError(
            f"fully_shard(module=...): a {type(module).__name__} has no forward, so the hooks that gather its params "
            f"({names[0]!r}, ...) would never run. Call fully_shard on each module inside it (for block in "
            "model.layers: fully_shard(block)), or on the module whose forward uses them"
        )
    _check_params(module, params, names)  # before the mesh: param errors need no process group
    group, replicate_group = _resolve_groups(mesh)
    unit = FlatUnit(module, params, names, refs, group, mp_policy, comm_policy, replicate_group)
    for p, n in zip(params, names):  # an optimizer built on these old params can then say what happened
        p._ragged_replaced_by = n
    if block_policy is not None:
        specs = {i: s for i, (n, p) in enumerate(zip(names, params)) if (s := block_policy(n, p)) is not None}
        unit.relayout(specs)
    unit.reshard_after_forward = reshard_after_forward is not False  # None: see the docstring
    _reset_iteration_flags(unit)
    unit.on_all_grads_ready = _post_backward
    setattr(module, _UNIT_ATTR, unit)
    _TRACKER.units.add(unit)
    module.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    module.register_forward_hook(_post_forward)
    _mix_in(module)
    register_state_dict_hooks(module)  # state_dict()/load_state_dict() speak DCP (sharding/state_dict.py)
    return module


def units_of(module: nn.Module) -> list[FlatUnit]:
    """The units under ``module``, outermost last (the order of ``fully_shard`` calls in the usual nesting)."""
    return [u for m in module.modules() if (u := getattr(m, _UNIT_ATTR, None)) is not None][::-1]


def _reset_iteration_flags(unit: FlatUnit):
    unit.backward_started = False
    unit.post_backward_done = False
    unit.grads_ready = 0


def _pre_forward(module, args, kwargs):
    unit: FlatUnit = getattr(module, _UNIT_ATTR)
    tr = _TRACKER
    # The outermost unit checks every unit under it before any state changes, so a bad param leaves no half-done
    # iteration behind; an inner unit checks itself only when it lives outside the root's module tree.
    if tr.depth == 0:
        under = units_of(module)
        for u in under:
            u.sync_with_sharded_params()
        tr.synced = {id(u) for u in under}
    elif id(unit) not in tr.synced:
        unit.sync_with_sharded_params()
        tr.synced.add(id(unit))
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
    if unit.cast_inputs_to is not None:
        return _cast_floating((args, kwargs), unit.cast_inputs_to)
    return None


def _post_forward(module, args, output):
    unit: FlatUnit = getattr(module, _UNIT_ATTR)
    tr = _TRACKER
    tr.depth -= 1
    if tr.recording and torch.is_grad_enabled():
        tr.post_forward_order.append(unit)
    unit.set_sharded_attrs()
    if unit.output_dtype is not None:
        output = _cast_floating(output, unit.output_dtype)
    grad_outputs = [t for t in _tensors(output) if t.requires_grad]
    if torch.is_grad_enabled() and grad_outputs:
        torch.autograd.graph.register_multi_grad_hook(grad_outputs, lambda _g, u=unit: _pre_backward(u), mode="any")
    keep = unit.is_root and torch.is_grad_enabled()  # the root's backward starts right away
    if not keep and (unit.reshard_after_forward or not torch.is_grad_enabled()):
        unit.reshard()
    if tr.depth == 0:
        tr.recording = False
    return output


def _cast_floating(obj, dtype: torch.dtype):
    """``obj`` (a pytree) with its floating-point tensors cast to ``dtype``, as MixedPrecisionPolicy does."""
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, obj)


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
