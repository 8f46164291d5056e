"""What every optimizer here checks before it touches params or state: one call, ``guard_step(self)``.

    @torch.no_grad()
    def step(self, closure=None):
        loss = ... closure ...
        if guard_step(self):
            return loss  # the step is skipped on every rank
        ...

Every step: non-finite gradients, decided on the device with one host sync. Each rank takes the 2-norm of every
local gradient with one ``torch._foreach_norm(grads)`` per device and dtype (a multi-tensor kernel on a GPU: no
kernel per param) and reduces those to one flag, ``any(!isfinite(norm))``, on the device; one ``all_reduce(MAX)``
of that flag (over the params' process group; under HSDP over the shard group, then the replicate group; the
world when params span several meshes) makes every rank see the same, and reading it (``.item()``) is the step's
only host sync. A NaN or Inf always makes its norm non-finite; a finite gradient can too, if its squares overflow
(|g| above ~1.8e19 in fp32 and bf16; fp16 grads are screened by their largest magnitude instead, a norm that cannot
overflow). So only when the flag is set, the params
are checked exactly, one by one (``isfinite``, one more ``all_reduce``), which names them, or clears a flag raised
by overflow. The 2-norm is the screen because a CPU computes it about 12x faster than the largest magnitude (small
GPT, 1.24M grads: 0.41 ms vs 5.0 ms). The policy is ``opt.nonfinite`` (set it with :func:`set_nonfinite_policy`):

- ``"skip"`` (default): the step is skipped on every rank: no param and no optimizer state changes (so nothing
  non-finite is ever written into them); ``opt.found_nonfinite`` counts skipped steps and a ``RuntimeWarning``
  names the params. The grads are left as they are (``zero_grad`` clears them as usual).
- ``"raise"``: a ``FloatingPointError`` naming the params, on every rank, before anything changes.
- ``"off"``: no check (no collective); non-finite grads go into the update.

First step only (results are cached on the optimizer):

- every param has a floating, real dtype (integer and complex params get a TypeError naming the param);
- no param is one that ``fully_shard`` replaced after the optimizer was built (such a param never gets a grad, so
  the optimizer would silently do nothing). ``fully_shard`` marks the params it replaces with
  ``_ragged_replaced_by`` (their name); without that mark, a plain param that has no grad and is not in the model
  that the optimizer's sharded params belong to is taken for a replaced one;
- every rank holds the same params: an ``all_gather`` of one hash of (group, full shape, dtype) of every param;
  when the hashes differ, the ranks' lists are gathered and the error names the first param that differs.

Plain (one-process) optimizers run no collective here.
"""

from __future__ import annotations

import warnings
import zlib

import torch
import torch.distributed as dist
from torch import Tensor

from ragged_optim.optim.base import full_shape, is_dtensor, local
from ragged_optim.sharding import shard_info
from ragged_optim.sharding.fully_shard import REPLACED_ATTR

__all__ = [
    "NONFINITE_POLICIES",
    "REPLACED_ATTR",
    "any_nonfinite",
    "guard_step",
    "nonfinite_params",
    "set_nonfinite_policy",
]

NONFINITE_POLICIES = ("skip", "raise", "off")
_CHECKED = "_ragged_guard_checked"


def set_nonfinite_policy(opt: torch.optim.Optimizer, policy: str) -> None:
    """``"skip"`` (default), ``"raise"`` or ``"off"``: what ``opt.step()`` does with NaN/Inf gradients."""
    if not getattr(type(opt), "checks_nonfinite_grads", False):
        raise TypeError(
            f"set_nonfinite_policy: {type(opt).__name__} is not a ragged-optim optimizer, and only those check grads "
            "in step(), so the policy would do nothing. For torch's optimizers check the grads yourself (e.g. "
            "a grad scaler skips steps with inf/NaN grads: on ragged_optim.fully_shard params torch's "
            "ShardedGradScaler, whose check agrees across ranks)"
        )
    if policy not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite policy must be one of {NONFINITE_POLICIES}, got {policy!r}")
    opt.nonfinite = policy


def _params(opt) -> list[tuple[int, int, Tensor]]:
    return [(gi, i, p) for gi, g in enumerate(opt.param_groups) for i, p in enumerate(g["params"])]


def _label(opt, gi: int, i: int, p: Tensor) -> str:
    names = opt.param_groups[gi].get("param_names")
    name = getattr(p, REPLACED_ATTR, None) or (names[i] if names else None)
    info = shard_info(p)
    name = name or (info.name if info is not None else None)
    named = f" ({name!r})" if name else ""
    return f"param_groups[{gi}]['params'][{i}]{named} with shape {tuple(full_shape(p))}"


def _is_distributed(p: Tensor) -> bool:
    return shard_info(p) is not None or is_dtensor(p)


def _world() -> list:
    return [dist.group.WORLD] if dist.get_world_size() > 1 else []


def _agreement_groups(params: list[Tensor]) -> list:
    """The process groups whose collectives, in this order, make every rank taking part in this optimizer's step
    agree ([] when no param is distributed). One mesh (1-D, or HSDP's shard x replicate grid): its shard group,
    then its replicate group (a flag reduced along the rows, then along the columns, is the whole grid's); groups
    are told apart by their ranks, so two group objects over the same ranks are one. Params on several meshes:
    the world. Never the world for one mesh: ranks outside it may be busy with other work (the step would hang,
    and two HSDP jobs in one world would skip each other's steps)."""
    pairs = {}  # by object first: the ranks of each distinct pair are looked up once (this runs every step)
    for p in params:
        info = shard_info(p)
        if info is not None and any(tp is not None for tp in info.unit.tp_parts):
            return _world()  # (a unit under tensor parallel: its dp group's ranks and their tp peers)
        if info is not None:
            pair = (info.unit.group, info.unit.replicate_group)
        elif is_dtensor(p):
            mesh = p.device_mesh
            if mesh.ndim != 1:
                return _world()
            pair = (mesh.get_group(), None)
        else:
            continue
        pairs.setdefault((id(pair[0]), id(pair[1])), pair)
    meshes = {}
    for pair in pairs.values():
        meshes.setdefault(tuple(None if g is None else tuple(dist.get_process_group_ranks(g)) for g in pair), pair)
    if not meshes:
        return []
    if len(meshes) > 1:
        return _world()
    return [g for g in next(iter(meshes.values())) if g is not None and dist.get_world_size(g) > 1]


# ---------------------------------------------------------------------------------------------------------------
# first-step checks
# ---------------------------------------------------------------------------------------------------------------


def _check_dtypes(opt, entries) -> None:
    cls = type(opt).__name__
    for gi, i, p in entries:
        if p.is_complex():
            raise TypeError(
                f"{cls}: {_label(opt, gi, i, p)} is complex ({p.dtype}); our optimizers support real params only: "
                "view it as real (torch.view_as_real) in the model, or give it to torch.optim.AdamW"
            )
        if not p.is_floating_point():
            raise TypeError(
                f"{cls}: {_label(opt, gi, i, p)} has dtype {p.dtype}; only floating-point params can be optimized. "
                "Leave it out of the optimizer (register it as a buffer if it is state, not a weight)"
            )


def _check_not_replaced(opt, entries) -> None:
    cls = type(opt).__name__
    fix = (
        "build the optimizer after fully_shard, from model.parameters() (fully_shard replaces the module's params "
        "with sharded ones; the old ones get no gradient)"
    )
    for gi, i, p in entries:
        if getattr(p, REPLACED_ATTR, None) is not None:
            raise RuntimeError(
                f"{cls}: {_label(opt, gi, i, p)} was replaced by fully_shard after the optimizer was built; {fix}"
            )
    modules = {id(m): m for _, _, p in entries if (info := shard_info(p)) is not None for m in info.unit.modules}
    if not modules:
        return
    reachable = {id(q) for m in modules.values() for q in m.parameters()}
    for gi, i, p in entries:
        if not _is_distributed(p) and p.grad is None and id(p) not in reachable:
            raise RuntimeError(
                f"{cls}: {_label(opt, gi, i, p)} is a plain tensor with no gradient that is not in the sharded model "
                f"of the optimizer's other params: it looks like a param fully_shard replaced; {fix}"
            )


def _describe(opt, entries) -> list[tuple]:
    return [(gi, tuple(full_shape(p)), str(p.dtype)) for gi, _, p in entries]


def _device(entries) -> torch.device:
    """Where this optimizer's collectives run: the params' device (NCCL takes CUDA tensors only)."""
    return next((local(p).device for _, _, p in entries), torch.device("cpu"))


def _check_same_params(opt, entries, groups) -> None:
    for group in groups:  # equal along the rows and along the columns of a grid: equal on all of it
        _check_same_params_in(opt, entries, group)


def _settings(opt) -> list[tuple]:
    """Every group's hyperparameters and the non-finite policy: a rank with another lr or ns_steps computed its
    pieces (or its owned matrices) with them, silently; a rank with another policy ran other collectives (a hang)."""
    groups = [
        (gi, sorted((k, _comparable(v)) for k, v in g.items() if k not in ("params", "param_names")))
        for gi, g in enumerate(opt.param_groups)
    ]
    return [("nonfinite", opt.__dict__.get("nonfinite", "skip")), *groups]


def _comparable(v) -> str:
    """A hyperparameter as ranks compare it: by value, never by what differs between processes (a tensor's device,
    an object's address)."""
    if isinstance(v, torch.Tensor):
        return repr(v.item()) if v.numel() == 1 else f"tensor{tuple(v.shape)} {v.dtype}"
    if isinstance(v, list | tuple):
        return f"({', '.join(_comparable(x) for x in v)})"
    if isinstance(v, set | frozenset):  # (printed in hash order, which differs between processes)
        return f"{{{', '.join(sorted(_comparable(x) for x in v))}}}"
    if isinstance(v, dict):
        return f"{{{', '.join(sorted(f'{_comparable(k)}: {_comparable(x)}' for k, x in v.items()))}}}"
    if callable(v) and not isinstance(v, type):
        return f"<{getattr(v, '__qualname__', type(v).__name__)}>"
    text = repr(v)
    return f"<{type(v).__name__}>" if " at 0x" in text else text


def _check_same_params_in(opt, entries, group) -> None:
    desc = (_describe(opt, entries), _settings(opt))
    h = torch.tensor([zlib.crc32(repr(desc).encode()), len(desc[0])], dtype=torch.int64, device=_device(entries))
    world = dist.get_world_size(group)
    out = [torch.zeros_like(h) for _ in range(world)]
    dist.all_gather(out, h, group=group)
    if all(torch.equal(o, out[0]) for o in out):
        return
    descs: list = [None] * world
    dist.all_gather_object(descs, desc, group=group)
    cls = type(opt).__name__
    r = next(k for k in range(world) if descs[k] != descs[0])
    ranks = dist.get_process_group_ranks(group)
    if descs[r][0] == descs[0][0]:  # the same params: other settings
        a, b = dict(descs[0][1]), dict(descs[r][1])
        key = next(k for k in [*a, *(k for k in b if k not in a)] if a.get(k) != b.get(k))
        if key not in a or key not in b:
            what = f"{len(a) - 1} param groups on rank {ranks[0]} but {len(b) - 1} on rank {ranks[r]}"
        elif key == "nonfinite":
            what = f"set_nonfinite_policy: {a[key]!r} on rank {ranks[0]} but {b[key]!r} on rank {ranks[r]}"
        else:
            da, db = dict(a[key]), dict(b.get(key, ()))
            k = next(k for k in sorted(set(da) | set(db)) if da.get(k) != db.get(k))
            what = f"param_groups[{key}][{k!r}] = {da.get(k)} on rank {ranks[0]} but {db.get(k)} on rank {ranks[r]}"
        raise RuntimeError(
            f"{cls}.step(): ranks disagree on the optimizer's settings ({what}). Every rank must build the optimizer "
            "with the same hyperparameters and policy (a value computed per rank, e.g. from the rank or a local "
            "file, makes them differ); nothing was updated"
        )
    a, b = descs[0][0], descs[r][0]
    j = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
    where = (
        f"param {j}: group {a[j][0]}, shape {a[j][1]}, {a[j][2]} on rank {ranks[0]} but group {b[j][0]}, shape "
        f"{b[j][1]}, {b[j][2]} on rank {ranks[r]}"
        if j < min(len(a), len(b))
        else f"rank {ranks[0]} has {len(a)} params, rank {ranks[r]} has {len(b)}"
    )
    raise RuntimeError(
        f"{cls}.step(): ranks disagree on the optimizer's params ({where}). Every rank must build the optimizer "
        "from the same model with the same param groups, in the same order (a rank-dependent filter, e.g. on "
        "requires_grad or on which params are non-empty locally, makes them differ). For expert parallel, every ep "
        "rank must hold as many experts, of the same shapes (experts divisible by ep): the optimizer's owner "
        "exchange spans every rank"
    )


# ---------------------------------------------------------------------------------------------------------------
# non-finite grads
# ---------------------------------------------------------------------------------------------------------------


def nonfinite_params(opt, entries=None, groups=()) -> list[int]:
    """Indices (into the flat param list) of params whose gradient holds a NaN/Inf on some rank (collectives over
    ``groups``, in order: every rank gets the same list)."""
    entries = _params(opt) if entries is None else entries
    device = _device(entries)
    index, finite = [], []
    for k, (_, _, p) in enumerate(entries):
        g = local(p.grad)
        if g is not None and g.is_sparse:  # the optimizer itself rejects sparse grads with a clear message
            g = g.coalesce().values()
        if g is not None and g.numel():
            index.append(k)
            finite.append(torch.isfinite(g).all())
    flags = torch.zeros(len(entries), dtype=torch.float32, device=device)
    if index:  # one device-side gather of the flags: no host sync per param
        flags[torch.tensor(index, device=device)] = (~torch.stack(finite).to(device)).float()
    for group in groups:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return torch.nonzero(flags).flatten().tolist()


def any_nonfinite(opt, entries=None, groups=()) -> bool:
    """False when every param's gradient is finite on every rank; True when some gradient holds a NaN/Inf, or (rarely)
    when its squares overflow (confirm with :func:`nonfinite_params`). One foreach norm per (device, dtype), the flags
    combined on the device, one ``all_reduce(MAX)`` per group of ``groups`` (two under HSDP), and one host sync
    (``.item()``)."""
    entries = _params(opt) if entries is None else entries
    buckets: dict[tuple, list[Tensor]] = {}
    for _, _, p in entries:
        g = local(p.grad)
        if g is not None and g.is_sparse:
            g = g.coalesce().values()
        if g is not None and g.numel():
            buckets.setdefault((g.device, g.dtype), []).append(g)
    device = _device(entries)
    # A NaN or Inf makes a norm non-finite. fp16 squares overflow at 256: its largest magnitude instead.
    norms = [torch.stack(torch._foreach_norm(gs, float("inf") if gs[0].dtype == torch.float16 else 2.0))
             for gs in buckets.values()]  # fmt: skip
    if not norms:  # no local grads (a rank may still have to join the all_reduce)
        finite = torch.ones((), dtype=torch.bool, device=device)
    else:
        finite = torch.isfinite(norms[0] if len(norms) == 1 else torch.cat([n.to(device) for n in norms])).all()
    if groups:
        bad = (~finite).to(torch.float32).reshape(1)
        for group in groups:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        return bool(bad.item())
    return not finite.item()


def guard_step(opt: torch.optim.Optimizer) -> bool:
    """Run the checks of this module for ``opt.step()``; True means: skip this step (on every rank)."""
    entries = _params(opt)
    params = [p for _, _, p in entries]
    groups = _agreement_groups(params) if dist.is_available() and dist.is_initialized() else []
    if not opt.__dict__.get(_CHECKED):
        _check_dtypes(opt, entries)
        _check_not_replaced(opt, entries)
        _check_same_params(opt, entries, groups)
        opt.__dict__[_CHECKED] = True
    policy = opt.__dict__.get("nonfinite", "skip")
    if policy == "off":
        return False
    if policy not in NONFINITE_POLICIES:
        raise ValueError(f"{type(opt).__name__}.nonfinite must be one of {NONFINITE_POLICIES}, got {policy!r}")
    if not any_nonfinite(opt, entries, groups):
        return False
    bad = nonfinite_params(opt, entries, groups)  # the rare case: name the params (every rank takes it together)
    if not bad:
        return False
    labels = [_label(opt, *entries[k]) for k in bad]
    shown = "; ".join(labels[:4]) + (f" and {len(labels) - 4} more" if len(labels) > 4 else "")
    cls = type(opt).__name__
    if policy == "raise":
        raise FloatingPointError(
            f"{cls}.step(): non-finite (NaN or Inf) gradient in {shown}; nothing was updated. Lower the lr, clip "
            "gradients, or set_nonfinite_policy(opt, 'skip') to skip such steps"
        )
    opt.found_nonfinite = opt.__dict__.get("found_nonfinite", 0) + 1
    warnings.warn(
        f"{cls}.step(): skipped (step {opt.found_nonfinite} so far with non-finite grads): NaN or Inf gradient in "
        f"{shown}; params and optimizer state are unchanged",
        RuntimeWarning,
        stacklevel=3,
    )
    return True
