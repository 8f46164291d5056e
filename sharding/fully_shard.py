"""`fully_shard`: the call shape of torch.distributed.fsdp.fully_shard, on RaggedShard flat buffers.

Each call makes one unit of the params under ``module`` that no inner call owns (two when some are frozen: the
frozen ones get no gradient buffer and no reduce-scatter). The hooks and the iteration state they drive live in
``runtime.py``: one state per call, one context per root module.
"""

from __future__ import annotations

import functools
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import UnshardHandle as TorchUnshardHandle

from ragged_optim.comm.collectives import serves_cuda
from ragged_optim.sharding.comm_policy import CommPolicy
from ragged_optim.sharding.flat_unit import FlatUnit
from ragged_optim.sharding.ragged_dtensor import adopt_mesh
from ragged_optim.sharding.rank_agreement import check_device, first_difference
from ragged_optim.sharding.replaced_params import REPLACED_ATTR, mark_replaced  # (REPLACED_ATTR: optim reads it)
from ragged_optim.sharding.replaced_params import REPLACED_IN_ATTR as _REPLACED_IN_ATTR
from ragged_optim.sharding.runtime import ModuleState, cast_floating
from ragged_optim.sharding.sharded_param import shard_info
from ragged_optim.sharding.state_dict import loading_strict, register_state_dict_hooks
from ragged_optim.sharding.tensor_parallel import tensor_parallel_part
from ragged_optim.sharding.unit_relayout import relayout

_STATE_ATTR = "_ragged_state"


def state_of(module: nn.Module) -> ModuleState | None:
    return getattr(module, _STATE_ATTR, None)


def _check_bool(method: str, name: str, value) -> None:
    if not isinstance(value, bool):  # ("False", a string, was taken for True)
        raise ValueError(f"{method}({name}={value!r}): takes True or False")


def _ours(method: str, modules) -> list[ModuleState]:
    if not isinstance(modules, list | tuple):
        raise TypeError(f"{method}(modules=...): takes a list of fully_shard modules, got a {type(modules).__name__}")
    states = []
    for m in modules:
        if (st := state_of(m)) is None:
            raise ValueError(
                f"{method}: {type(m).__name__} is not a ragged_optim.fully_shard module (prefetching works between "
                "units of this library; torch FSDP2 modules cannot be mixed in)"
            )
        states.append(st)
    return states


class RaggedFSDPModule(FSDPModule):
    """Mixed into a module's class by ``fully_shard``, as torch's ``FSDPModule`` is (so ``isinstance(m, FSDPModule)``
    holds and frameworks find the methods they call). Every public method of torch's FSDPModule is either
    implemented here or refused with an error that names it: none falls through to torch's, which would read
    FSDP2's private state."""

    # [RaggedFSDP<Orig>, RaggedFSDPModule, FSDPModule, Orig, ...]: FSDPModule.__new__ builds Orig from index 3
    _orig_cls_mro_index = 3

    def _get_fsdp_state(self):
        """What torch's own helpers read from an FSDP2 module: only the forward hooks exist here (so that
        ``torch.distributed.fsdp.register_fsdp_forward_method`` works on our modules); FSDP2's private state does
        not."""
        return _TorchStateView(self)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the reduced gradients by ``factor`` instead of averaging over the data-parallel ranks (1.0: the
        sum, as torchtitan sets it), for this module's units (not recursive, as FSDP2's)."""
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0:
            raise ValueError(f"set_gradient_divide_factor(factor={factor!r}): takes a positive number")
        for unit in state_of(self).units:
            unit.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """torch's deprecated name of :meth:`set_gradient_divide_factor`."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated (as in torch): use set_gradient_divide_factor",
            FutureWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with SUM and divide afterwards even where the backend could average (NCCL's AVG); gloo always
        sums here. Not recursive, as FSDP2's."""
        _check_bool("set_force_sum_reduction_for_comms", "enable", enable)
        for unit in state_of(self).units:
            unit.force_sum_reduction = enable

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward accumulates grads locally (no reduce-scatter) until it is set back to True."""
        _check_bool("set_requires_gradient_sync", "requires_gradient_sync", requires_gradient_sync)
        for unit in units_of(self) if recurse else state_of(self).units:
            unit.requires_grad_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: whether to all-reduce across replicas after the reduce-scatter. Units without replicas have no
        all-reduce, so True and False are the same there (as in FSDP2). Skipping it under HSDP (accumulating
        partly reduced grads) is not implemented and is refused."""
        _check_bool("set_requires_all_reduce", "requires_all_reduce", requires_all_reduce)
        units = units_of(self) if recurse else state_of(self).units
        if not requires_all_reduce and any(u.replicate_group is not None for u in units):
            raise NotImplementedError(
                "set_requires_all_reduce(False) on a ragged_optim.fully_shard HSDP module: accumulating grads without "
                "the all-reduce across replicas is not implemented; use set_requires_gradient_sync(False) for "
                "micro-batches (no reduce-scatter, no all-reduce)"
            )

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        _check_bool("set_reshard_after_forward", "reshard_after_forward", reshard_after_forward)
        for state in _states_under(self) if recurse else [state_of(self)]:
            state.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: keep the gathered params after backward; the next forward reuses them when no in-place op has
        changed the shard since (gradient accumulation), and gathers again otherwise."""
        _check_bool("set_reshard_after_backward", "reshard_after_backward", reshard_after_backward)
        for state in _states_under(self) if recurse else [state_of(self)]:
            state.reshard_after_backward = reshard_after_backward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 code. Here every backward lands its reduced grads at its end, so the flag changes
        nothing observable (FSDP2 uses False to skip waiting for the reduce-scatters until a later backward)."""
        _check_bool("set_is_last_backward", "is_last_backward", is_last_backward)
        state_of(self).is_last_backward = is_last_backward

    def set_modules_to_forward_prefetch(self, modules: list) -> None:
        """Gather these modules' units right after this one's, in forward (instead of the next in forward order)."""
        state_of(self).forward_prefetch = _ours("set_modules_to_forward_prefetch", modules)

    def set_modules_to_backward_prefetch(self, modules: list) -> None:
        """Gather these modules' units at this one's pre-backward (instead of the next in backward order)."""
        state_of(self).backward_prefetch = _ours("set_modules_to_backward_prefetch", modules)

    def _refuse(self, method: str, why: str):
        raise NotImplementedError(f"{method} on a ragged_optim.fully_shard {type(self).__name__}: {why}")

    def set_custom_all_gather(self, comm) -> None:
        self._refuse("set_custom_all_gather", "the all-gather is the flat-buffer one; use comm_policy= of fully_shard")

    def set_custom_reduce_scatter(self, comm) -> None:
        self._refuse("set_custom_reduce_scatter", "use comm_policy= of fully_shard (e.g. grad_reduce='bf16')")

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        self._refuse("set_all_reduce_hook", "not implemented; reduce grads yourself after backward instead")

    def set_post_optim_event(self, event) -> None:
        self._refuse("set_post_optim_event", "not implemented; the next forward waits on the current stream")

    def set_reduce_scatter_unused_params(self, *args, **kwargs) -> None:
        self._refuse(
            "set_reduce_scatter_unused_params", "every rank always reduces every param (zeros where unused) here"
        )

    def set_reduce_scatter_max_input_buffers(self, *args, **kwargs) -> None:
        self._refuse("set_reduce_scatter_max_input_buffers", "one reduce-scatter input is alive at a time here")

    def set_separate_reduce_scatter_group(self, *args, **kwargs) -> None:
        self._refuse("set_separate_reduce_scatter_group", "not implemented")

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        self._refuse("set_unshard_in_backward", "every unit with params is gathered for its backward here")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        self._refuse("set_allocate_memory_from_process_group_for_comm", "not implemented")

    def set_symm_mem_for_comm(self, *args, **kwargs) -> None:
        self._refuse("set_symm_mem_for_comm", "not implemented")

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
            out = super(FSDPModule, self)._apply(fn, recurse)  # (not FSDPModule._apply: it reads FSDP2 state)
        finally:
            for unit in own:
                unit.apply_to_shard(fn)
        return out


class _TorchStateView:
    """Answers the two calls of torch's ``register_fsdp_forward_method`` with our forward hooks; anything else of
    FSDP2's private state is refused by name."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def _pre_forward(self, module, args, kwargs):
        return _pre_forward_hook(module, args, kwargs)

    def _post_forward(self, module, args, output):
        return _post_forward_hook(module, args, output)

    def __getattr__(self, name: str):
        raise NotImplementedError(
            f"{type(self._module).__name__} is a ragged_optim.fully_shard module: it has no torch FSDP2 state "
            f"({name!r} of _get_fsdp_state()). Use the public FSDPModule methods, which this module implements"
        )


class UnshardHandle(TorchUnshardHandle):
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


def _check_fsdp2_only_args(shard_placement_fn, offload_policy, ignored_params) -> None:
    """FSDP2's keywords: the values that mean what they mean there are taken, the others refused by name."""
    from torch.distributed.fsdp import OffloadPolicy

    if shard_placement_fn is not None:
        raise NotImplementedError(
            "fully_shard(shard_placement_fn=...): ragged_optim's planner places every param (ragged ranges of one "
            "flat buffer), so a per-param Shard(dim) is not taken. Leave it None; to keep optimizer blocks whole, "
            "pass block_policy= (or let our optimizers re-plan the units)"
        )
    if offload_policy is not None and type(offload_policy) is not OffloadPolicy:
        raise NotImplementedError(
            f"fully_shard(offload_policy={offload_policy!r}): CPU offload is not supported by ragged_optim's "
            "fully_shard (the shards stay on the unit's device). Pass None or OffloadPolicy() (no offload), or use "
            "torch's fully_shard for offloading"
        )
    if ignored_params is not None and not (
        isinstance(ignored_params, set | frozenset | list | tuple)
        and all(isinstance(p, torch.Tensor) for p in ignored_params)
    ):
        raise TypeError(
            f"fully_shard(ignored_params=...) takes a set of params (as FSDP2), got a {type(ignored_params).__name__}"
        )


def _check_args(module, reshard_after_forward, mp_policy, block_policy, comm_policy):
    """Type checks that need no process group, so a wrong argument fails here rather than deep in a hook."""
    if isinstance(module, list | tuple):
        if not module:
            raise ValueError("fully_shard(module=[]): the list of modules is empty; pass one module or several")
        for k, m in enumerate(module):
            if not isinstance(m, nn.Module):
                raise TypeError(f"fully_shard(module=[...]): item {k} is a {type(m).__name__}, not an nn.Module")
        if len({id(m) for m in module}) != len(module):
            raise ValueError("fully_shard(module=[...]): a module appears twice in the list")
        for k, m in enumerate(module):
            for j, other in enumerate(module):
                if j != k and any(sub is m for sub in other.modules()):
                    raise ValueError(
                        f"fully_shard(module=[...]): item {k} ({type(m).__name__}) is inside item {j} "
                        f"({type(other).__name__}); list modules that do not contain one another"
                    )
    elif not isinstance(module, nn.Module):
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


def _named_modules(modules: list[nn.Module]):
    """(name, module) under every module of a ``fully_shard`` call; a list's items are named by their index."""
    for k, module in enumerate(modules):
        for mod_name, mod in module.named_modules(remove_duplicate=False):
            head = str(k) if len(modules) > 1 else ""
            yield ".".join(x for x in (head, mod_name) if x), mod


def _collect_params(modules: list[nn.Module]):
    """Params under ``modules`` not owned by an inner unit, deduplicated (tied weights), in registration order; and
    the ties to a param an earlier call outside them sharded: (name here, that module, its name for it)."""
    params, names, refs, seen, outside = [], [], [], {}, []
    inside = {id(m) for module in modules for m in module.modules()}
    module = modules[0]
    for mod_name, mod in _named_modules(modules):
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
                where = next((n for n, m in _named_modules(modules) if m is holder and n), None)
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


def _check_params(modules: list[nn.Module], params, names):
    torch_fsdp = _torch_fsdp_params(modules) if any(hasattr(p, "placements") for p in params) else set()
    for p, n in zip(params, names):
        if id(p) in torch_fsdp:
            raise ValueError(
                f"fully_shard: param {n!r} is already sharded by torch's fully_shard (FSDP2): a module takes one of "
                "the two. Build the model again and call ragged_optim.fully_shard where torch's was"
            )
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


def _torch_fsdp_params(modules) -> set[int]:
    """ids of the params that torch's fully_shard (FSDP2) sharded somewhere under ``modules``."""
    return {
        id(p)
        for root in modules
        for m in root.modules()
        if isinstance(m, FSDPModule) and state_of(m) is None
        for p in m.parameters()
    }


def _shard_mesh(mesh):
    """The mesh of the shard dim: ``mesh`` itself, or its second dim for HSDP's (replicate, shard) when named."""
    if isinstance(mesh, DeviceMesh) and mesh.ndim == 2 and mesh.mesh_dim_names:
        return mesh[mesh.mesh_dim_names[1]]
    return mesh


def _tensor_parallel_parts(params, names, mesh) -> list:
    """Per param: its tensor-parallel layout (a DTensor from parallelize_module), or None for a plain param."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in params):
        return [None] * len(params)
    shard_mesh = _shard_mesh(mesh)
    full = mesh if isinstance(mesh, DeviceMesh) else None
    return [
        tensor_parallel_part(p, n, shard_mesh, full) if isinstance(p, DTensor) else None for p, n in zip(params, names)
    ]


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh=None,
    reshard_after_forward: bool | None = True,
    shard_placement_fn=None,
    mp_policy=None,
    offload_policy=None,
    ignored_params: set | None = None,
    block_policy=None,
    comm_policy=None,
):
    """Shard ``module``'s params (those no inner ``fully_shard`` owns) into one RaggedShard unit; returns module.

    ``module`` may be a list of modules, as in FSDP2 (e.g. ``[model.norm, model.lm_head]``): one unit for all
    their params, gathered whenever any of them runs forward, inside or outside the root's forward (a chunked
    loss calling the head by itself), and resharded after each such forward unless ``reshard_after_forward`` is
    False. Each module of the list is then an ``FSDPModule`` sharing that unit.

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
    ``ignored_params``: params left out of the unit, as in FSDP2 (not sharded, their grads not reduced: the
    module keeps them as plain params). ``offload_policy``: only torch's ``OffloadPolicy()`` (no offload, its
    default) or None; ``shard_placement_fn``: only None (the planner places params: ``block_policy``). Both are
    taken so that code passing FSDP2's keywords (accelerate's FSDP2 path) runs unchanged.
    ``reshard_after_forward``: True, False, or None (torch's default: True for inner units, and the root keeps
    its params for backward; our root always does, so None and True behave the same). ``requires_grad_`` on a
    sharded param takes effect at the next forward; cast or move the module before fully_shard (use mp_policy for
    low-precision compute). Non-contiguous params are accepted (their values are copied into the flat buffer). A
    module with no params of its own makes an empty unit that communicates nothing.
    """
    _check_args(module, reshard_after_forward, mp_policy, block_policy, comm_policy)
    _check_fsdp2_only_args(shard_placement_fn, offload_policy, ignored_params)
    module_arg = module
    modules = list(module) if isinstance(module, list | tuple) else [module]
    for m in modules:
        if state_of(m) is not None:
            raise ValueError(f"fully_shard was already called on this {type(m).__name__}; call it once per module")
    params, names, refs, ties_outside = _collect_params(modules)
    if ignored_params:
        ignored = {id(p) for p in ignored_params}
        kept = [k for k, p in enumerate(params) if id(p) not in ignored]
        params, names, refs = [params[k] for k in kept], [names[k] for k in kept], [refs[k] for k in kept]
    for m in modules:
        _check_no_split_ties(m)
    # Hooks run around forward: a ModuleList or ModuleDict has none, so its submodules' own forward would see the
    # sharded params. (Other modules without forward are left alone: tests and optimizer-only uses set grads by hand
    # or call unshard().) An empty unit, every param already in an inner unit, is harmless.
    bare = [m for m in modules if isinstance(m, nn.ModuleList | nn.ModuleDict)]
    if params and bare:
        module = bare[0]
        raise TypeError(
            f"fully_shard(module=...): a {type(module).__name__} has no forward, so the hooks that gather its params "
            f"({names[0]!r}, ...) would never run. Call fully_shard on each module inside it (for block in "
            "model.layers: fully_shard(block)), or on the module whose forward uses them"
        )
    module = modules[0]
    _check_params(modules, params, names)  # before the mesh: param errors need no process group
    group, replicate_group = _resolve_groups(mesh)
    tp_parts = _tensor_parallel_parts(params, names, mesh)
    device = _target_device(mesh, params, group)
    _check_ranks_pass_alike(module, params, names, (group, replicate_group), device)
    if isinstance(shard_mesh := _shard_mesh(mesh), DeviceMesh):
        adopt_mesh(shard_mesh)
    # the buffers go where a mesh says, or where the params move (never to meta because the params are there)
    for m in modules:
        if isinstance(mesh, DeviceMesh):
            _move_buffers(m, _device_of_type(mesh.device_type))
        elif params and params[0].device.type != "meta" and device != params[0].device:
            _move_buffers(m, device)
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
            tp_parts=[tp_parts[i] for i in idx],
        )
        for idx in split
    ]
    for unit in units:
        unit.modules = modules
    for p, n in zip(params, names):  # an optimizer built on these old params raises at its step (replaced_params)
        mark_replaced(p, n, module)
    if block_policy is not None:
        for unit, idx in zip(units, split):
            specs = {k: spec for k, i in enumerate(idx) if (spec := block_policy(names[i], params[i])) is not None}
            relayout(unit, specs)
    # None: see the docstring
    state = ModuleState(module, units, reshard_after_forward=reshard_after_forward is not False)
    state.modules = modules
    state.ties_outside = ties_outside
    for m in modules:
        setattr(m, _STATE_ATTR, state)
        m.register_forward_pre_hook(_pre_forward_hook, prepend=True, with_kwargs=True)
        m.register_forward_hook(_post_forward_hook, always_call=True)
        _mix_in(m)
        register_state_dict_hooks(m)  # state_dict()/load_state_dict() speak DCP (sharding/state_dict.py)
    return modules if isinstance(module_arg, list | tuple) else module


def units_of(module: nn.Module) -> list[FlatUnit]:
    """The units under ``module``, outermost last (the order of ``fully_shard`` calls in the usual nesting)."""
    return [u for s in _states_under(module)[::-1] for u in s.units]


def _states_under(module: nn.Module) -> list[ModuleState]:
    """Module pre-order, each state once (a ``fully_shard([a, b])`` state sits on both modules)."""
    out, seen = [], set()
    for m in module.modules():
        if (s := state_of(m)) is not None and id(s) not in seen:
            seen.add(id(s))
            out.append(s)
    return out


def _check_ranks_pass_alike(module: nn.Module, params, names, groups, device: torch.device) -> None:
    """Every rank of the unit's groups must pass the same params (names, logical shapes, dtypes, trainable or
    frozen), before anything is sharded: one all_reduce of a digest per group. A model built differently on one rank
    or an EP layout whose ranks of one mesh hold different experts otherwise misaligns the first all-gathers (gloo
    aborts the process) or, with the same shapes, averages different tensors."""
    desc = [(n, list(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad) for n, p in zip(names, params)]
    for group in groups:
        if (where := first_difference(group, check_device(group, device), desc)) is None:
            continue
        raise ValueError(
            f"fully_shard({type(module).__name__}): ranks sharded different models: its mesh's ranks pass different "
            f"params ({where}; this rank passes {len(desc)} params). Every rank of the mesh must build the same "
            "module (same config, shapes, dtypes) and call fully_shard on it. For expert parallel, fully_shard the "
            "experts over the ranks that hold the same experts (the dp dim inside the ep dim, e.g. mesh['dp'] of a "
            "(dp, ep) mesh), with as many experts on each of them; nothing was sharded"
        )


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
