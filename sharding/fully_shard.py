"""`fully_shard`: the call shape of torch.distributed.fsdp.fully_shard, on RaggedShard flat buffers.

Each call makes one unit of the params under ``module`` that no inner call owns (two when some are frozen: the
frozen ones get no gradient buffer and no reduce-scatter). The hooks and the iteration state they drive live in
``runtime.py``: one state per call, one context per root module.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ragged_optim.comm.collectives import serves_cuda
from ragged_optim.sharding.comm_policy import CommPolicy
from ragged_optim.sharding.flat_unit import FlatUnit
from ragged_optim.sharding.replaced_params import REPLACED_ATTR, mark_replaced  # (REPLACED_ATTR: optim reads it)
from ragged_optim.sharding.replaced_params import REPLACED_IN_ATTR as _REPLACED_IN_ATTR
from ragged_optim.sharding.runtime import ModuleState, cast_floating
from ragged_optim.sharding.sharded_param import shard_info
from ragged_optim.sharding.state_dict import loading_strict, register_state_dict_hooks

_STATE_ATTR = "_ragged_state"


def state_of(module: nn.Module) -> ModuleState | None:
    return getattr(module, _STATE_ATTR, None)


class RaggedFSDPModule:
    """Mixed into a module's class by ``fully_shard`` (as torch's FSDPModule is), for the familiar methods."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward accumulates grads locally (no reduce-scatter) until it is set back to True."""
        if not isinstance(requires_gradient_sync, bool):  # ("False", a string, was taken for True)
            raise ValueError(
                f"set_requires_gradient_sync(requires_gradient_sync={requires_gradient_sync!r}): takes True or False"
            )
        for unit in units_of(self) if recurse else state_of(self).units:
            unit.requires_grad_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"set_reshard_after_forward(reshard_after_forward={reshard_after_forward!r}): takes True or False"
            )
        for m in self.modules() if recurse else [self]:
            if (state := state_of(m)) is not None:
                state.reshard_after_forward = reshard_after_forward

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this module's own units now (not those of inner ``fully_shard`` calls), as FSDP2's: the module's
        params are the full tensors until ``reshard()`` or the next forward's end reshards them. ``async_op``:
        return a handle whose ``wait()`` finishes the gather (the all-gathers are in flight meanwhile)."""
        units = state_of(self).units
        for unit in units:
            unit.start_unshard()
        handle = UnshardHandle(units)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        for unit in state_of(self).units:
            unit.reshard()

    def reset_iter_state(self) -> None:
        """Forget an iteration whose forward or backward raised. The next forward does this by itself; call it
        to free the gathered and gradient buffers sooner. Sharded grads of finished iterations are kept."""
        state = state_of(self)
        if state.ctx is not None:
            state.ctx.reset()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's, with ``strict`` seen by the checks that run before anything is written: torch passes its
        load-state-dict hooks ``strict=True`` whatever the call said, and applies ``strict`` only at the end."""
        with loading_strict(strict):
            return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def __deepcopy__(self, memo):
        raise TypeError(
            f"copy.deepcopy of a ragged_optim.fully_shard {type(self).__name__}: its params live in per-rank flat "
            "buffers tied to a process group, which a copy cannot share (FSDP2 refuses too). Copy the weights: build "
            "a new model and load ragged_optim.get_full_state_dict(model) into it"
        )

    def _apply(self, fn, recurse=True):
        """``to_empty``/``to(device)`` after sharding move each unit's flat shard as one tensor and re-point the
        sharded params into it; casts are refused before anything changes (the layout depends on the dtype)."""
        if recurse:
            for unit in units_of(self):
                unit.check_apply_keeps_dtype(fn)
        own = state_of(self).units
        for unit in own:
            unit.unset_attrs()
        try:
            out = super()._apply(fn, recurse)
        finally:
            for unit in own:
                unit.apply_to_shard(fn)
        return out


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns: ``wait()`` completes the all-gathers and puts the full params on
    the module (as FSDP2's handle does)."""

    def __init__(self, units: list[FlatUnit]) -> None:
        self._units = units

    def wait(self) -> None:
        for unit in self._units:
            unit.wait_unshard()
            unit.set_unsharded_attrs()
        self._units = []


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
    """Params under ``module`` not owned by an inner unit, deduplicated (tied weights), in registration order; and
    the ties to a param an earlier call outside ``module`` sharded: (name here, that module, its name for it)."""
    params, names, refs, seen, outside = [], [], [], {}, []
    inside = {id(m) for m in module.modules()}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            name = f"{mod_name}.{attr}" if mod_name else attr
            if (info := shard_info(p)) is not None:
                if id(info.unit.module) not in inside:  # an enclosing module was sharded first
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
            holder = getattr(p, _REPLACED_IN_ATTR, lambda: None)()
            if holder is not None and id(holder) in inside:  # tied to a param an inner unit of this tree sharded
                where = next((n for n, m in module.named_modules() if m is holder and n), None)
                owner = getattr(p, REPLACED_ATTR)
                raise ValueError(_tie_message(module, name, f"{where}.{owner}" if where else owner))
            if holder is not None:  # a sibling's unit, or another model's: an error once one call encloses both
                outside.append((name, weakref.ref(holder), getattr(p, REPLACED_ATTR)))
            seen[id(p)] = len(params)
            params.append(p)
            names.append(name)
            refs.append([(mod, attr)])
    return params, names, refs, outside


def _tie_message(module: nn.Module, name: str, other: str) -> str:
    return (
        f"fully_shard: param {name!r} of this {type(module).__name__} is the same tensor as {other!r}, which another "
        "fully_shard call sharded into its own unit: tied (shared) weights must be in one unit, or training would "
        "untie them. Don't call fully_shard on a module that holds only one side of a tie (e.g. the LM head tied to "
        "the embedding): leave both to the enclosing call (fully_shard(model))"
    )


def _check_no_split_ties(module: nn.Module) -> None:
    """Two earlier calls under ``module`` (siblings: ``fully_shard(m.emb); fully_shard(m.head)``) each took one
    side of a tie: refused here, at the call that encloses both, as FSDP2 refuses it. Two separate models that share
    a tensor are not a tie of one tree, and are left alone."""
    paths = {id(m): n for n, m in module.named_modules()}
    for m in module.modules():
        for name, holder, owner in getattr(state_of(m), "ties_outside", ()):
            if (h := holder()) is not None and id(h) in paths:
                here = ".".join(x for x in (paths[id(m)], name) if x)
                raise ValueError(_tie_message(module, here, ".".join(x for x in (paths[id(h)], owner) if x)))


def _check_params(module: nn.Module, params, names):
    for p, n in zip(params, names):
        if not p.is_floating_point():
            raise TypeError(f"fully_shard: param {n!r} has dtype {p.dtype}; only floating-point params can be sharded")
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
    if state_of(module) is not None:
        raise ValueError(f"fully_shard was already called on this {type(module).__name__}; call it once per module")
    params, names, refs, ties_outside = _collect_params(module)
    _check_no_split_ties(module)
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
    device = _target_device(mesh, params, group)
    # the buffers go where a mesh says, or where the params move (never to meta because the params are there)
    if isinstance(mesh, DeviceMesh):
        _move_buffers(module, _device_of_type(mesh.device_type))
    elif params and params[0].device.type != "meta" and device != params[0].device:
        _move_buffers(module, device)
    # Frozen params go in a unit of their own: no gradient buffer, no reduce-scatter bytes for them.
    trainable = [p.requires_grad for p in params]
    split = [[i for i, t in enumerate(trainable) if t], [i for i, t in enumerate(trainable) if not t]]
    split = [idx for idx in split if idx] or [[]]  # a module with no params of its own: one empty unit
    units = [
        FlatUnit(
            module,
            [params[i] for i in idx],
            [names[i] for i in idx],
            [refs[i] for i in idx],
            group,
            mp_policy,
            comm_policy,
            replicate_group,
            device=device,
        )
        for idx in split
    ]
    for p, n in zip(params, names):  # an optimizer built on these old params raises at its step (replaced_params)
        mark_replaced(p, n, module)
    if block_policy is not None:
        for unit, idx in zip(units, split):
            specs = {k: spec for k, i in enumerate(idx) if (spec := block_policy(names[i], params[i])) is not None}
            unit.relayout(specs)
    # None: see the docstring
    state = ModuleState(module, units, reshard_after_forward=reshard_after_forward is not False)
    state.ties_outside = ties_outside
    setattr(module, _STATE_ATTR, state)
    module.register_forward_pre_hook(_pre_forward_hook, prepend=True, with_kwargs=True)
    module.register_forward_hook(_post_forward_hook, always_call=True)
    _mix_in(module)
    register_state_dict_hooks(module)  # state_dict()/load_state_dict() speak DCP (sharding/state_dict.py)
    return module


def units_of(module: nn.Module) -> list[FlatUnit]:
    """The units under ``module``, outermost last (the order of ``fully_shard`` calls in the usual nesting)."""
    return [u for s in _states_under(module)[::-1] for u in s.units]


def _states_under(module: nn.Module) -> list[ModuleState]:
    return [s for m in module.modules() if (s := state_of(m)) is not None]


def _target_device(mesh, params, group) -> torch.device:
    """Where the unit lives, as FSDP2 decides: the params' device, or the mesh's device type when a DeviceMesh names
    another one, or the current CUDA device when CPU params meet a group that runs on NCCL (FSDP2's default mesh is
    CUDA's; NCCL takes CUDA tensors only). Meta params stay on meta."""
    device = params[0].device if params else torch.device("cpu")
    if device.type == "meta":
        return device
    if isinstance(mesh, DeviceMesh):
        want = mesh.device_type
    elif device.type == "cpu" and torch.cuda.is_available() and serves_cuda(group):
        want = "cuda"
    else:
        return device
    return device if device.type == want else _device_of_type(want)


def _device_of_type(kind: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    """The module's buffers follow its params to ``device``, as FSDP2 moves them (a rotary ``inv_freq`` left on
    the CPU would meet CUDA params in the forward). Buffers are not sharded."""
    for mod in module.modules():
        for name, buf in mod._buffers.items():
            if buf is not None and buf.device != device and buf.device.type != "meta":
                mod._buffers[name] = buf.to(device)


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>()`` gather and reshard this module's params around its call as ``forward()`` does
    (FSDP2's function of this name; ``torch.distributed.fsdp.register_fsdp_forward_method`` does nothing to our
    modules). For methods other than forward that use the module's own params, e.g. an ``encode()`` that reads
    the root's embedding: without it they see the sharded 1-D pieces."""
    if state_of(module) is None:
        raise ValueError(
            f"register_fsdp_forward_method: {type(module).__name__} is not a ragged_optim.fully_shard module; call "
            "ragged_optim.fully_shard(module) first"
        )
    method = getattr(module, method_name, None)
    if not callable(method):
        raise AttributeError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")

    @functools.wraps(method)
    def gathered(*args, **kwargs):
        args, kwargs = _pre_forward_hook(module, args, kwargs)
        try:
            output = method(*args, **kwargs)
        except BaseException:
            _post_forward_hook(module, args, None)  # what forward's always_call hook does when forward raises
            raise
        return _post_forward_hook(module, args, output)

    setattr(module, method_name, gathered)


@torch._disable_dynamo
def _pre_forward_hook(module, args, kwargs):
    state = state_of(module)
    state.lazy_init(_states_under(module))
    args, kwargs = state.pre_forward(args, kwargs)
    cast_to = state.units[0].cast_inputs_to
    if cast_to is not None:
        args, kwargs = cast_floating((args, kwargs), cast_to)
    return args, kwargs


@torch._disable_dynamo
def _post_forward_hook(module, args, output):
    state = state_of(module)
    out_dtype = state.units[0].output_dtype
    if out_dtype is not None and output is not None:
        output = cast_floating(output, out_dtype)
    return state.post_forward(output)
