"""The aten ops a :class:`~ragged_optim.sharding.ragged_dtensor.RaggedDTensor` runs, and why only these.

A RaggedDTensor holds a ragged piece of the flattened tensor on each rank, so an op is local exactly when it is
element-wise: it runs on the local pieces and the result keeps the ranges. That covers what code written for
FSDP2's DTensor params does to params, grads and optimizer state: torch's optimizers (foreach, fused or the
per-param loop: every ``_foreach_*`` op, the ``_fused_*`` kernels, ``zeros_like`` state), in-place init
(``nn.init.*_``: ``normal_``, ``uniform_``, ``fill_``, ``zero_``, and the element-wise ops around them),
``p.copy_(full)`` (each rank takes its range of a full-shape tensor, as a DTensor ``copy_`` from a replicated
source does), ``p.mul_``. Norms (``linalg_vector_norm``, ``_foreach_norm``: what ``clip_grad_norm_`` calls) return
a torch DTensor with a partial-norm placement on the same mesh: torch's own op rules then stack and combine them
and reduce across ranks where a value is needed, exactly as for FSDP2's grads. Whole-tensor reductions (``any``,
``all``, ``max``, ``min``, ``sum``, ``mean`` with no dim: ``trunc_normal_``'s loop) reduce across the ranks at once
and give a replicated DTensor; ``t.new_empty(size)`` (and ``new_zeros``, ``new_ones``, ``new_full``) of another
shape gives a replicated DTensor on t's mesh, as on FSDP2. Anything else (matmul, views,
indexing, reductions over a dim) would need the whole tensor and is refused with a message naming the op and
``full_tensor()``.

Operands: RaggedDTensors of the same ranges (the same param's layout: a param, its grad, its state), Python
scalars, 0-d tensors, torch DTensors of one element (a clip coefficient: replicated, or reduced first), and a plain
tensor or torch DTensor of the full shape (cut to this rank's range; a sharded DTensor is gathered first). So
``p.copy_(full)`` works where FSDP2's DTensor refuses a plain tensor, and ``p.copy_(distribute_tensor(full, ...))``
works as on FSDP2.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._pytree import tree_flatten, tree_unflatten

aten = torch.ops.aten

#: in-place ops that fill or draw values element by element (nn.init); not tagged pointwise in aten
_ELEMENTWISE_FILLS = {
    aten.normal_.default,
    aten.uniform_.default,
    aten.bernoulli_.float,
    aten.exponential_.default,
    aten.geometric_.default,
    aten.log_normal_.default,
    aten.cauchy_.default,
    aten.random_.default,
    getattr(aten.random_, "from"),  # (a keyword in Python)
    aten.random_.to,
    aten.fill_.Scalar,
    aten.fill_.Tensor,
    aten.zero_.default,
    aten.copy_.default,
}
#: factories shaped like their input: made on the local piece
_LIKE = {
    aten.empty_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.rand_like.default,
    aten.randn_like.default,
    aten.clone.default,
    aten._to_copy.default,
}
#: ``t.new_*(size)``: of t's own shape a piece laid out like t; of another shape a replicated torch DTensor on t's
#: mesh, as FSDP2's DTensor gives (torchtitan's fused-QKV init draws q, k, v so, then ``copy_``s them into t)
_NEW_FACTORIES = {aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default}
#: reductions of the whole tensor (no dim): each rank reduces its piece, then the ranks combine (torch 2.13's
#: ``trunc_normal_`` loops on ``mask.any()`` of the param it fills). Per op: how the ranks' values combine, and the
#: value of an empty piece (the identity of that combination; max and min of nothing raise)
_WHOLE_REDUCTIONS = {
    aten.any.default: ("MAX", 0.0),
    aten.all.default: ("MIN", 1.0),
    aten.max.default: ("MAX", -math.inf),
    aten.min.default: ("MIN", math.inf),
    aten.sum.default: ("SUM", 0.0),
    aten.mean.default: ("SUM", 0.0),  # (a sum, divided by the numel once combined)
}
_NORMS = {aten.linalg_vector_norm.default, aten.norm.Scalar, aten.norm.ScalarOpt_dim}
_FOREACH_NORMS = {aten._foreach_norm.Scalar}


#: torch's fused optimizer kernels (``fused=True``): element-wise per tensor of their lists, like foreach ops
_FUSED_OPTIMIZERS = {
    getattr(getattr(aten, name), overload)
    for name in ("_fused_adamw_", "_fused_adam_", "_fused_sgd_", "_fused_adagrad_")
    for overload in ("default", "tensor_lr")
}


def is_elementwise(func) -> bool:
    if func in _ELEMENTWISE_FILLS or func in _LIKE or func in _FUSED_OPTIMIZERS:
        return True
    name = func._schema.name
    if name.startswith("aten::_foreach_"):
        return func not in _FOREACH_NORMS and "max" not in name
    return torch.Tag.pointwise in func.tags


def refuse(func, what: str = "") -> RuntimeError:
    return RuntimeError(  # not TypeError: torch turns that into NotImplemented for operators
        f"{func} on a ragged-sharded tensor (a param, grad or optimizer state of ragged_optim.fully_shard){what}: "
        "each rank holds a ragged piece of the flattened tensor, so only element-wise ops and norms run on it. "
        "Call .full_tensor() (a collective: every rank) for the full value, or .to_local() for this rank's piece"
    )


class _Local:
    """Turns the operands of one op into local tensors, checking that every ragged operand has the reference's
    ranges (per position of a foreach list)."""

    def __init__(self, func, refs: list):
        self.func = func
        self.refs = refs  # per list position (or [ref] for a plain op): the RaggedDTensor whose ranges rule

    def one(self, t, pos: int):
        from ragged_optim.sharding.ragged_dtensor import RaggedDTensor

        ref = self.refs[pos] if pos < len(self.refs) else self.refs[0]
        if isinstance(t, RaggedDTensor):
            if ref is not None and (t.shape != ref.shape or t._ragged_ranges != ref._ragged_ranges):
                raise RuntimeError(
                    f"{self.func} on ragged-sharded tensors of different layouts ({tuple(t.shape)} and "
                    f"{tuple(ref.shape)}, or the same shape cut at other ranks): only tensors laid out like one "
                    "param (the param, its grad, its state) combine element by element. A twin model updated from "
                    "this one (an EMA, a teacher): call ro.match_layout(twin, model) after building the optimizer; "
                    "otherwise use .full_tensor()"
                )
            return t._local_tensor
        if isinstance(t, DTensor):
            if t.numel() == 1:
                return t.full_tensor()  # replicated: its local value; partial: reduced (every rank runs this op)
            if ref is not None and tuple(t.shape) == tuple(ref.shape):  # e.g. distribute_tensor(full, ...)
                replicated = all(pl.is_replicate() for pl in t.placements)
                return ref.local_part_of(t.to_local() if replicated else t.full_tensor())
            raise refuse(self.func, f" with a torch DTensor of shape {tuple(t.shape)} (placements {t.placements})")
        if isinstance(t, torch.Tensor) and t.dim() > 0 and ref is not None:
            if tuple(t.shape) == tuple(ref.shape):
                return ref.local_part_of(t)
            if t.numel() == 1:
                return t
            raise refuse(self.func, f" with a plain tensor of shape {tuple(t.shape)} (neither 0-d nor the full shape)")
        return t

    def tree(self, obj):
        flat, spec = tree_flatten(obj)
        return tree_unflatten([self.one(t, 0) for t in flat], spec)


def _first_ragged(obj):
    from ragged_optim.sharding.ragged_dtensor import RaggedDTensor

    flat, _ = tree_flatten(obj)
    return next((t for t in flat if isinstance(t, RaggedDTensor)), None)


#: per op, computed once: (element-wise without tensor lists, i.e. the fast path applies; mutates its first operand)
_KIND: dict = {}


def _flat_elementwise(func, args, kwargs):
    """The common case, fast: an element-wise op whose operands are tensors of one param's layout, 0-d tensors
    and numbers (torch's per-param optimizer loop makes ~10 of these per param and step). None: not this case."""
    from ragged_optim.sharding.ragged_dtensor import RaggedDTensor

    ref, local_args = None, []
    for a in args:
        if type(a) is RaggedDTensor:
            if ref is None:
                ref = a
            elif a._ragged_ranges is not ref._ragged_ranges and (
                a._ragged_ranges != ref._ragged_ranges or a.shape != ref.shape
            ):
                return None
            local_args.append(a._local_tensor)
        elif isinstance(a, DTensor) or isinstance(a, torch.Tensor) and a.dim() > 0 or isinstance(a, list | tuple):
            return None  # (a torch DTensor, a full tensor, a list: the general path)
        else:
            local_args.append(a)
    if ref is None or any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in kwargs.values()):
        return None
    out = func(*local_args, **kwargs)
    if _KIND[func][1]:  # mutates its first operand
        return args[0]
    return ref._rewrap(out) if isinstance(out, torch.Tensor) and out.shape == ref._local_tensor.shape else None


def dispatch(func, args, kwargs):
    """``func(*args, **kwargs)`` with at least one RaggedDTensor among the operands."""
    from ragged_optim.sharding.ragged_dtensor import RaggedDTensor

    kind = _KIND.get(func)
    if kind is None:
        flat = is_elementwise(func) and not func._schema.name.startswith("aten::_foreach_") and func not in _NORMS
        flat = flat and func not in _FUSED_OPTIMIZERS
        kind = _KIND[func] = (flat, _mutates_first(func))
    if kind[0]:
        out = _flat_elementwise(func, args, kwargs)
        if out is not None:
            return out
    if func in (aten.detach.default, aten.alias.default):
        return args[0]._rewrap(args[0]._local_tensor.detach())
    if func is aten.detach_.default:
        return args[0]
    if func in _NEW_FACTORIES and isinstance(args[0], RaggedDTensor):
        return _new_factory(func, args, kwargs)
    if func in _NORMS:
        return _norm(func, args, kwargs)
    if func in _WHOLE_REDUCTIONS:
        return _whole_reduction(func, args, kwargs)
    if func is aten._amp_foreach_non_finite_check_and_unscale_.default:
        return _unscale(func, args, kwargs)
    if func in (aten.equal.default, aten.allclose.default):
        return _all_ranks_agree(func, args, kwargs)
    if func in _FOREACH_NORMS:
        local = [_partial_norm(t, n, _ord(args, kwargs)) for t, n in zip(args[0], func(*_locals(args), **kwargs))]
        return local
    if not is_elementwise(func):
        raise refuse(func)
    lists = [a for a in args if isinstance(a, list | tuple) and a and isinstance(a[0], torch.Tensor)]
    if lists:  # foreach: position j of every list is one tensor's op
        width = len(lists[0])
        refs = [next((lst[j] for lst in lists if isinstance(lst[j], RaggedDTensor)), None) for j in range(width)]
        conv = _Local(func, refs)
        local_args = [
            [conv.one(t, j) for j, t in enumerate(a)] if isinstance(a, list | tuple) and a and isinstance(
                a[0], torch.Tensor) else conv.one(a, 0)
            for a in args
        ]  # fmt: skip
        out = func(*local_args, **{k: conv.tree(v) for k, v in kwargs.items()})
        if func._schema.name.endswith("_") or out is None:  # in place: the operands hold the result
            return None if out is None else args[0]
        return [ref._rewrap(o) if ref is not None else o for ref, o in zip(refs, out)]
    ref = _first_ragged((args, kwargs))
    conv = _Local(func, [ref])
    out = func(*conv.tree(list(args)), **conv.tree(kwargs))
    if _mutates_first(func):
        return args[0]
    if isinstance(out, torch.Tensor) and out.shape == ref._local_tensor.shape:
        return ref._rewrap(out)
    raise refuse(func, f" (it gave a {tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__})")


def _new_factory(func, args, kwargs):
    t, size, *rest = args
    if tuple(size) == tuple(t.shape):  # (DCP's async stager copies a DTensor as new_empty(its size), then fills it)
        return t._rewrap(func(t._local_tensor, t._local_tensor.shape, *rest, **kwargs))
    mesh = t.device_mesh
    return DTensor.from_local(func(t._local_tensor, size, *rest, **kwargs), mesh, [Replicate()] * mesh.ndim,
                              run_check=False)  # fmt: skip


def _mutates_first(func) -> bool:
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def _locals(args):
    return [[t._local_tensor for t in args[0]], *args[1:]]


def _ord(args, kwargs) -> float:
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p", 2))
    return 2.0 if ord_ is None else float(ord_)


def _norm(func, args, kwargs):
    t = args[0]
    rest = list(args[1:])
    dims = (rest[1] if len(rest) > 1 else kwargs.get("dim")) if func is not aten.norm.Scalar else None
    if dims not in (None, [], ()):
        raise refuse(func, f" over dims {dims} (only the norm of the whole tensor)")
    local = func(t._local_tensor, *rest, **kwargs)
    return _partial_norm(t, local, _ord(args, kwargs))


def _partial_norm(t, local: torch.Tensor, ord_: float) -> DTensor:
    """This rank's norm of its piece as a torch DTensor that reduces across the ranks to the norm of the whole."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._ops._math_ops import _NormPartial

    # (under tensor parallel: partial over the TP dims that shard the tensor too; replicated over the others)
    placements = [Replicate() if type(pl) is Replicate else _NormPartial(norm_type=ord_) for pl in t.placements]
    return DTensor.from_local(local, t.device_mesh, placements, run_check=False)


def _whole_reduction(func, args, kwargs) -> DTensor:
    """``t.any()``, ``t.sum()``, ``t.max()``...: this rank's piece reduced (an empty piece gives the op's identity),
    combined in float64 over the mesh dims that cut the tensor (RaggedShard's and TP's; RaggedShard derives from
    Replicate, hence the exact type test), as a replicated torch DTensor: what FSDP2's DTensor gives once reduced.
    A collective, as there: every rank of the mesh runs it."""
    from ragged_optim.comm.collectives import all_reduce_flat

    t, *rest = args
    loc, (how, identity) = t._local_tensor, _WHOLE_REDUCTIONS[func]
    mean = func is aten.mean.default
    local_op = aten.sum.default if mean else func
    out = local_op(loc if loc.numel() else loc.new_zeros(1), *rest, **kwargs)  # (empty: for the dtype only)
    combined = torch.tensor([float(out) if loc.numel() else identity], dtype=torch.float64, device=loc.device)
    op = getattr(torch.distributed.ReduceOp, how)
    for dim, pl in enumerate(t.placements):
        if type(pl) is not Replicate:
            all_reduce_flat(combined, group=t.device_mesh.get_group(dim), op=op)
    if mean:
        combined /= t.numel()
    mesh = t.device_mesh
    return DTensor.from_local(combined[0].to(out.dtype), mesh, [Replicate()] * mesh.ndim, run_check=False)


def _unscale(func, args, kwargs):
    """``GradScaler.unscale_``: unscale each rank's pieces, then take the overflow flag's max over each mesh of the
    grads, so every rank skips the same steps (as DTensor does for FSDP2's grads; a flag per rank made the ranks
    diverge silently)."""
    from ragged_optim.comm.collectives import all_reduce_flat

    grads, found_inf, inv_scale = args
    func([g._local_tensor if isinstance(g, DTensor) else g for g in grads], found_inf, inv_scale, **kwargs)
    meshes = {id(g.device_mesh): g.device_mesh for g in grads if isinstance(g, DTensor)}
    for mesh in meshes.values():
        for dim in range(mesh.ndim):
            all_reduce_flat(found_inf, group=mesh.get_group(dim), op=torch.distributed.ReduceOp.MAX)
    return None


def _all_ranks_agree(func, args, kwargs) -> bool:
    """``torch.equal`` / ``torch.allclose`` of the whole tensors: each rank compares its pieces, then every rank
    learns whether all did (a collective, as DTensor's ``equal`` is)."""
    from ragged_optim.comm.collectives import all_reduce_flat

    ref = _first_ragged(args)
    a, b = (_Local(func, [ref]).one(t, 0) for t in args[:2])
    same = a.shape == b.shape and bool(func(a, b, *args[2:], **kwargs))
    flag = torch.tensor([0.0 if same else 1.0], device=ref._local_tensor.device)
    for dim in range(ref.device_mesh.ndim):
        all_reduce_flat(flag, group=ref.device_mesh.get_group(dim), op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item() == 0.0)
