"""A :class:`~ragged_optim.optim.blocks.BlockOptimizer`'s state schema, read: what each of its state entries is
(:meth:`BlockOptimizer.state_schema`, else :func:`~ragged_optim.sharding.state_schema.default_kind`), and the one
conversion of its state dict that every save and load path goes through, on ragged, FSDP2 and plain params.

``state_dict()`` (:func:`state_to_dcp`): :class:`Elem` entries of a ragged param become full-shape RaggedDTensors,
of an FSDP2 param DTensors of its global shape and placements (as torch's optimizers keep them); :class:`Blocks`
``"value"`` / ``"element"`` entries RaggedDTensors over all the param's blocks (``[n_blocks]``) or elements (the
full shape), each rank holding its blocks in its ``block_state_ranges``; ``"dict"`` entries stay dicts by block
index (DCP keeps every rank's keys); :class:`Replicated` entries stay as they are. A plain param's entries stay as
they are (``"element"`` ones shaped like the param). Each entry is checked against its kind first, and an entry
the schema does not cover is refused, naming the key and the fix.

``load_state_dict()`` (:func:`state_from_dcp`): the inverse, from any form DCP, torch's state-dict API, a full state
dict or a rank-local state dict gives: this rank's pieces; a ``"dict"`` entry keeps the blocks this rank computes
(a full state dict has them all), and is refused when it lacks one of them for a param with saved state, or when a
block's ``step`` is not its param's (a mix of two runs).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ragged_optim.optim.base import full_shape, is_dtensor, local, local_of_full, process_group
from ragged_optim.sharding import shard_info
from ragged_optim.sharding.ragged_dtensor import RaggedDTensor, ragged_dtensor
from ragged_optim.sharding.state_dict import _full_value, elem_local_piece, local_piece, sharded_dtensor
from ragged_optim.sharding.state_schema import Blocks, Elem, Replicated, StateKind, as_kind, default_kind, n_blocks

__all__ = [
    "block_layout",
    "declared_schema",
    "is_block_dict",
    "kind_of",
    "param_label",
    "state_from_dcp",
    "state_to_dcp",
]

FIX = (
    "declare it in {cls}.state_schema(p, group): ro.Blocks(self.block_spec(p, group)) for state kept per block (a "
    "dict by block index), ro.Blocks(spec, form='value') for one value per block, ro.Elem() for one value per "
    "element, ro.Replicated() for the same value on every rank"
)


def is_block_dict(kind: StateKind) -> bool:
    return isinstance(kind, Blocks) and kind.form == "dict"


def param_label(opt, gi: int, i: int) -> str:
    """How messages name a param: its place in the groups, its name when given, its full shape."""
    group = opt.param_groups[gi]
    names = group.get("param_names")
    named = f" ({names[i]!r})" if names and i < len(names) else ""
    return f"param_groups[{gi}]['params'][{i}]{named} with shape {tuple(full_shape(group['params'][i]))}"


def declared_schema(opt, p: torch.Tensor, group: dict) -> dict[str, StateKind]:
    """``opt.state_schema(p, group)``, checked: a mapping of state keys to kinds, every :class:`Blocks` of the
    param's own block spec (the blocks whose state a rank keeps are those it computes). Cached per param."""
    cache = opt.__dict__.setdefault("_state_schema_cache", {})
    if id(p) in cache:
        return cache[id(p)]
    cls = type(opt).__name__
    raw = opt.state_schema(p, group)
    if not isinstance(raw, Mapping):
        raise TypeError(f"{cls}.state_schema must return a dict of state keys to kinds, got {type(raw).__name__}")
    out = {}
    for key, kind in raw.items():
        kind = as_kind(kind, f"{cls}.state_schema(...)[{key!r}] of a param of shape {tuple(full_shape(p))}")
        if isinstance(kind, Blocks):
            spec = opt.block_spec(p, group)
            if spec != kind.spec:
                raise ValueError(
                    f"{cls}.state_schema declares {key!r} as {kind} for a param of shape {tuple(full_shape(p))} "
                    f"whose block_spec is {spec}: per-block state lives on the rank that computes each block of the "
                    "param's block_spec, so declare ro.Blocks(self.block_spec(p, group), ...)"
                )
        out[key] = kind
    cache[id(p)] = out
    return out


def kind_of(opt, p: torch.Tensor, group: dict, key: str, value: Any, label: str) -> StateKind:
    """The kind of state entry ``key`` of ``p``: declared, else the default; an entry neither covers is refused."""
    kind = declared_schema(opt, p, group).get(key)
    if kind is None:
        kind = default_kind(key, value, tuple(local(p).shape), tuple(full_shape(p)))
    if kind is None:
        cls = type(opt).__name__
        is_tensor = isinstance(value, torch.Tensor)
        what = f"a tensor of shape {tuple(value.shape)}" if is_tensor else f"a {type(value).__name__}"
        raise ValueError(
            f"{cls}: state {key!r} of {label} is {what}, which {cls}.state_schema does not declare, and it is not "
            f"shaped like the param's local piece {tuple(local(p).shape)}: saved as it is, it would load whole on "
            f"every rank (wrong at another world size). Fix: {FIX.format(cls=cls)}"
        )
    return kind


def block_layout(opt, p: torch.Tensor, kind: Blocks) -> tuple[tuple[int, ...], list[list[tuple[int, int]]]]:
    """``(global shape, every rank's flat ranges of it)`` of a ``"value"`` or ``"element"`` entry of a distributed
    param: each rank's ranges are its :meth:`block_state_ranges` (in elements, or in block indices), adjacent
    ones merged."""
    spans = [[(s, e) for s, e in rs if e > s] for rs in opt.block_state_ranges(p)]
    if kind.form == "element":
        return tuple(full_shape(p)), [_merged(rs) for rs in spans]
    spec = kind.spec
    numel = math.prod(full_shape(p))
    last = lambda e: spec.block_index(spec.block_of(e - 1, numel)[0]) + spec.tiles_per_block  # noqa: E731
    blocks = [[(spec.block_index(s), last(e)) for s, e in rs] for rs in spans]
    return (n_blocks(spec, numel),), [_merged(rs) for rs in blocks]


def _merged(ranges) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if b <= a:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _block_count_here(opt, p, kind: Blocks) -> int:
    if process_group(p) is None:
        numel = math.prod(full_shape(p))
        return numel if kind.form == "element" else n_blocks(kind.spec, numel)
    _, ranges = block_layout(opt, p, kind)
    return sum(b - a for a, b in ranges[_rank(p)])


def _rank(p) -> int:
    return dist.get_rank(process_group(p))


def _check(opt, p, kind: StateKind, key: str, value: Any, label: str) -> None:
    """The optimizer's own entry agrees with its declared kind, or a ValueError naming the param, key and fix."""
    cls = type(opt).__name__
    problem = None
    if isinstance(kind, Elem):
        n = local(p).numel()
        if not isinstance(value, torch.Tensor) or value.numel() != n:
            got = f"{value.numel()} elements" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
            problem = f"is declared {kind} (one value per element of the local piece: {n}) but holds {got}"
    elif is_block_dict(kind):
        if not isinstance(value, Mapping) or not all(isinstance(b, int) for b in value):
            what = type(value).__name__ if not isinstance(value, Mapping) else f"keys {sorted(map(repr, value))[:4]}"
            problem = f"is declared {kind} (a dict by block index, an int) but holds {what}"
    elif isinstance(kind, Blocks):
        n = _block_count_here(opt, p, kind)
        if not isinstance(value, torch.Tensor) or value.numel() != n:
            got = f"{value.numel()} elements" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
            unit = "value per block" if kind.form == "value" else "element of each block"
            problem = f"is declared {kind} (one {unit} this rank computes: {n}) but holds {got}"
    if problem:
        raise ValueError(
            f"{cls}: state {key!r} of {label} {problem}: the schema disagrees with the state the optimizer keeps. "
            f"Fix {cls}.state_schema (or the state the step keeps) so that they agree"
        )


def _entries(opt, state_dict: dict):
    """(saved param id, param, group, label) of every param, matched by position as torch's loader does; [] when
    the groups do not line up (torch's own check then says what is wrong)."""
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list):
        return []
    ids = [i for g in groups if isinstance(g, dict) for i in g.get("params", [])]
    ours = [(gi, i, p, g) for gi, g in enumerate(opt.param_groups) for i, p in enumerate(g["params"])]
    if len(ids) != len(ours):
        return []
    return [(pid, p, g, (opt, gi, i)) for pid, (gi, i, p, g) in zip(ids, ours)]


# ---------------------------------------------------------------------------------------------------------------
# state_dict
# ---------------------------------------------------------------------------------------------------------------


def _wrap(opt, p, kind: StateKind, v: Any) -> Any:
    info = shard_info(p)
    if isinstance(kind, Elem) and isinstance(v, torch.Tensor) and not isinstance(v, DTensor):
        if info is not None:
            return sharded_dtensor(v, info)
        if is_dtensor(p):
            lp = local(p)
            return DTensor.from_local(
                v.view(lp.shape), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
    elif isinstance(kind, Blocks) and kind.form != "dict" and not isinstance(v, DTensor):
        if info is not None or is_dtensor(p):
            shape, ranges = block_layout(opt, p, kind)
            return ragged_dtensor(v, shape, ranges, _rank(p), process_group(p))
        if kind.form == "element" and v.numel() == math.prod(full_shape(p)):
            return v.view(full_shape(p))  # a plain param's: shaped like it, as a sharded one's state dict has it
    return v


def state_to_dcp(opt, state_dict: dict) -> dict:
    """``opt.state_dict()`` by the schema (see the module doc); new dicts, the optimizer's state is untouched."""
    new_state = dict(state_dict["state"])
    for pid, p, group, where in _entries(opt, state_dict):
        st = new_state.get(pid)
        if not st:
            continue
        label = param_label(*where)
        out = {}
        for k, v in st.items():
            kind = kind_of(opt, p, group, k, v, label)
            _check(opt, p, kind, k, v, label)
            out[k] = _wrap(opt, p, kind, v)
        new_state[pid] = out
    return {**state_dict, "state": new_state}


# ---------------------------------------------------------------------------------------------------------------
# load_state_dict
# ---------------------------------------------------------------------------------------------------------------


def _unwrap(opt, p, kind: StateKind, v: Any) -> Any:
    if not isinstance(v, torch.Tensor):
        return v
    info = shard_info(p)
    if isinstance(kind, Elem):
        if info is not None:
            return elem_local_piece(v, info, tuple(local(p).shape))
        if is_dtensor(p):
            if isinstance(v, DTensor) and not isinstance(v, RaggedDTensor) and v.shape == p.shape:
                same = v.device_mesh == p.device_mesh and tuple(v.placements) == tuple(p.placements)
                return (v if same else v.redistribute(p.device_mesh, p.placements)).to_local()
            if isinstance(v, RaggedDTensor) or tuple(v.shape) == tuple(p.shape):  # a full (or ragged) value: its part
                return local_of_full(p, _full_value(v))
            return v
        return _full_value(v) if isinstance(v, DTensor) else v
    if isinstance(kind, Blocks) and kind.form != "dict":
        if info is not None or is_dtensor(p):
            shape, ranges = block_layout(opt, p, kind)
            if isinstance(v, DTensor) or v.numel() == math.prod(shape):  # else: a rank-local piece, as saved
                return local_piece(v, ranges, _rank(p), shape, ())
            return v
        return _full_value(v) if isinstance(v, DTensor) else v
    return v


def _step_of(state: Any) -> float | None:
    step = state.get("step") if isinstance(state, Mapping) else None
    return float(step) if isinstance(step, torch.Tensor | int | float) and not isinstance(step, bool) else None


def _blocks_here(opt, p, key: str, blocks: Any, st: dict, label: str) -> dict:
    """The saved ``"dict"`` entry ``key`` of ``p`` narrowed to the blocks this rank computes, keyed by int (torch's
    flattening makes them strings), after checking that it holds them all and that none is of another step."""
    cls = type(opt).__name__
    if not isinstance(blocks, Mapping):
        raise ValueError(
            f"{cls}.load_state_dict: state {key!r} of {label} is a {type(blocks).__name__}, but {cls} declares it "
            "per block (a dict by block index): a state dict saved by another optimizer or another version of it?"
        )
    group = process_group(p)
    distributed = group is not None and dist.get_world_size(group) > 1
    if distributed and any(isinstance(b, str) for b in blocks):
        raise ValueError(
            f"{cls}.load_state_dict: the saved {key!r} blocks of {label} have string keys: this state came through "
            "torch's set_state_dict(..., full_state_dict=True), which holds the saving rank's blocks only (each "
            "block's state lives on one rank), so the other ranks would restart theirs fresh. Save and load with "
            "DCP's sharded state dict (get_state_dict without full_state_dict, dcp.save / dcp.load), "
            "ro.save_checkpoint / ro.load_checkpoint, or ro.get_full_optimizer_state_dict(model, opt) and "
            "opt.load_state_dict"
        )
    blocks = {int(b) if isinstance(b, str) and b.isdigit() else b: v for b, v in blocks.items()}
    odd = [b for b in blocks if not isinstance(b, int)]
    if odd:
        raise ValueError(
            f"{cls}.load_state_dict: state {key!r} of {label} has block keys {odd[:4]}; blocks are keyed by their "
            "index (an int): a state dict saved by another optimizer?"
        )
    here = set(opt.blocks_computed_here(p))
    missing = sorted(here - set(blocks))
    if missing and (blocks or len(st) > 1):
        raise ValueError(
            f"{cls}.load_state_dict: the saved state of {label} lacks block(s) {missing[:4]} of {key!r}, which this "
            f"rank computes (it has {sorted(blocks)[:4]}). Each block's state lives on one rank, and torch's "
            "get_state_dict(..., full_state_dict=True) keeps the saving rank's only: save with "
            "ro.get_full_optimizer_state_dict(model, opt) (all blocks), DCP's sharded state dict, or "
            "ro.save_checkpoint"
        )
    step = _step_of(st)
    stale = [b for b in sorted(here & set(blocks)) if step is not None and _step_of(blocks[b]) not in (None, step)]
    if stale:
        raise ValueError(
            f"{cls}.load_state_dict: block(s) {stale[:4]} of {key!r} of {label} were last updated at step "
            f"{_step_of(blocks[stale[0]]):g}, the param's saved state is at step {step:g}: the state dict mixes "
            "blocks of two runs. torch's get_state_dict(..., full_state_dict=True) keeps the saving rank's blocks "
            "only, and its loader fills the others from the loading optimizer's own first step. Save with "
            "ro.get_full_optimizer_state_dict(model, opt) (all blocks), DCP's sharded state dict, or "
            "ro.save_checkpoint"
        )
    return {b: v for b, v in blocks.items() if b in here}


def state_from_dcp(opt, state_dict: Any) -> Any:
    """The inverse of :func:`state_to_dcp` for loading (see the module doc). An entry the schema does not cover
    passes as it is (the optimizer's own checks judge it); a state dict that is not one is returned unchanged."""
    if not (isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict)):
        return state_dict
    new_state = dict(state_dict["state"])
    for pid, p, group, where in _entries(opt, state_dict):
        st = new_state.get(pid)
        if not isinstance(st, dict):
            continue
        label = param_label(*where)
        kinds = declared_schema(opt, p, group)
        out = {}
        for k, v in st.items():
            kind = kinds.get(k) or default_kind(k, v, tuple(local(p).shape), tuple(full_shape(p)))
            if kind is None or isinstance(kind, Replicated):
                out[k] = v
            elif is_block_dict(kind):
                out[k] = _blocks_here(opt, p, k, v, st, label)
            else:
                out[k] = _unwrap(opt, p, kind, v)
        new_state[pid] = out
    return {**state_dict, "state": new_state}
