"""The optimizer-first API: an optimizer declares which blocks of each param it needs whole, and computes on them.

An optimizer built on :class:`BlockOptimizer` (a ``torch.optim.Optimizer``) says, per param, which blocks it
computes on (:meth:`BlockOptimizer.block_spec`: runs of b elements, bands of g rows, whole matrices, each matrix of
a stack). The sharding layer lays ragged-sharded params out so that those blocks are whole on one rank wherever it
can; each step :meth:`BlockOptimizer.map_blocks` hands the optimizer every block this rank computes, as views into
its local tensors, plus the blocks a rank boundary cuts that this rank owns, gathered whole (one ``all_to_all`` per
process group for all of them), and scatters the results of those back (one more). The same code runs on plain
tensors (every block local), on ``ragged_optim.fully_shard`` params and on torch FSDP2 ``DTensor`` params
(``Shard(0)``: row chunks no planner chose, so more blocks are cut). Muon, Shampoo, SOAP and AdamW8bit are built on
exactly this API. A complete example: docs/custom_optimizer.md.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ragged_optim.optim.base import (
    full_shape,
    is_dtensor,
    local,
    local_range,
    local_slice,
    process_group,
    runs_of_rank,
)
from ragged_optim.optim.state_schema import declared_schema, is_block_dict, state_from_dcp, state_to_dcp
from ragged_optim.sharding import BlockSpec
from ragged_optim.sharding.block_routing import BlockRouting
from ragged_optim.sharding.dtensor_layout import check_placements, dtensor_layout
from ragged_optim.sharding.owner_balance import default_block_cost
from ragged_optim.sharding.state_schema import StateKind
from ragged_optim.sharding.unit_layout import declare_blocks, lock_layouts

__all__ = [
    "Block",
    "BlockOptimizer",
    "BlockSpec",
    "all_reduce_over_shards",
    "declare_blocks",
    "full_shape",
    "local",
    "local_range",
]


@dataclass
class Block:
    """One block an optimizer computes on this rank, whole.

    ``values`` holds one tensor per input given to :meth:`BlockOptimizer.map_blocks`, each shaped ``shape``: a view
    into the local input for a block this rank holds whole (in-place changes land in the input), a gathered copy for
    a block assembled here from other ranks' pieces (``gathered``; in the widest dtype of the inputs exchanged with
    it, e.g. fp32 when bf16 and fp32 params share a process group).

    A tile of a :meth:`BlockSpec.tiles` spec is a ``[rows, cols]`` view of its band (strided: in-place changes land
    in the band); ``start``/``end`` are its band's flat range and ``tile`` its ``(first row, first column)`` in its
    matrix."""

    param: Tensor  # the param as the optimizer holds it (the key of its state)
    index: int  # the block's ordinal in the param, flat order (keep per-block state under it); tiles count tiles
    start: int  # flat element range [start, end) of the full (unsharded) param (of a tile: its band's)
    end: int
    shape: tuple[int, ...]  # (rows, row_len) for bands and matrices, (rows, cols) for tiles, (n,) for runs
    values: tuple[Tensor, ...]
    gathered: bool
    tile: tuple[int, int] | None = None  # a tile's (first row, first column) in its matrix; None: not a tile

    @property
    def value(self) -> Tensor:
        """The first input's block (the usual case of one input)."""
        return self.values[0]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _split_tiles(blocks: list[Block], sinks: list[tuple], spec_of) -> tuple[list[Block], list[tuple]]:
    """Each band of a tiled spec as its tiles (views into the band), with sinks that say where each tile's result
    goes in its band: ``("tile", band sink, rows, row_len, first column)``."""
    out_b, out_s = [], []
    for b, sink in zip(blocks, sinks):
        spec = spec_of(b.param)
        if not spec.tile_cols:
            out_b.append(b)
            out_s.append(sink)
            continue
        rows, cols = b.shape
        row0 = (b.start % spec.period) // cols
        for j, (c0, w) in enumerate(spec.tile_columns()):
            vals = tuple(v[:, c0 : c0 + w] for v in b.values)
            out_b.append(Block(b.param, b.index + j, b.start, b.end, (rows, w), vals, b.gathered, (row0, c0)))
            out_s.append(("tile", sink, rows, cols, c0))
    return out_b, out_s


def all_reduce_over_shards(t: Tensor, p: Tensor, op: str = "sum") -> Tensor:
    """``t`` reduced over the ranks that hold pieces of ``p`` (its shard group; replicas of an HSDP mesh hold the same
    values and are not included), in place; returns ``t``. A plain tensor's param: ``t`` as is. ``op``: ``"sum"``,
    ``"max"`` or ``"min"``. A collective: every rank of the group must call it. Use it for a global norm of a
    sharded tensor: ``all_reduce_over_shards(local(g).square().sum(), p).sqrt()``."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"all_reduce_over_shards: op must be one of {sorted(ops)}, got {op!r}")
    group = process_group(p)
    if group is not None and dist.get_world_size(group) > 1:
        if op == "sum" and is_dtensor(p):  # replicas of a DTensor's elements (Replicate mesh dims) count once
            h = dtensor_layout(p).holding()
            if h.ranks[0] != dist.get_rank(group):
                t.zero_()
        dist.all_reduce(t, op=ops[op], group=group)
    return t


def _local_block_spans(spec: BlockSpec, lo: int, hi: int, numel: int, skip: set[int]) -> list[tuple[int, int]]:
    """The blocks wholly inside ``[lo, hi)`` whose start is not in ``skip`` (the routed ones)."""
    out = []
    x = lo
    while x < hi:
        s, e = spec.block_of(x, numel)
        if s >= lo and e <= hi and s not in skip:
            out.append((s, e))
        x = e
    return out


def _computed_spans(spec: BlockSpec, runs, numel: int, routed: list, rank: int) -> list[tuple[int, int]]:
    """The blocks rank ``rank`` computes, as sorted, merged flat ranges: those wholly inside one of its ``runs``
    (``(start, end, local start)``: :func:`runs_of_rank`) that are not routed elsewhere, and the routed ones it owns
    (a few: no loop over every block of a large param)."""
    spans = []
    cut = sorted((s, e) for s, e, _ in routed)
    starts = [s for s, _ in cut]
    for lo, hi, _ in runs:
        if hi <= lo:
            continue
        s0, e0 = spec.block_of(lo, numel)
        a = lo if s0 == lo else e0  # the first block boundary at or after lo
        b = hi if hi >= numel else spec.block_of(hi, numel)[0]  # the last one at or before hi
        x = a
        for s, e in cut[bisect.bisect_left(starts, a) : bisect.bisect_right(starts, b)]:
            if e > b:
                break
            if s > x:
                spans.append((x, s))
            x = max(x, e)
        if b > x:
            spans.append((x, b))
    spans += [(s, e) for s, e, route in routed if route is not None and route.owner == rank]
    merged: list[tuple[int, int]] = []
    for s, e in sorted(spans):
        if merged and merged[-1][1] == s:
            merged[-1] = (merged[-1][0], e)
        else:
            merged.append((s, e))
    return merged


def _own_runs(p: Tensor) -> list[tuple[int, int, int]]:
    """This rank's runs of ``p`` whose blocks it may compute where they lie (:func:`runs_of_rank`); a plain param's:
    all of it."""
    if not is_dtensor(p):
        lo, hi = local_range(p)
        return [(lo, hi, 0)] if hi > lo else []
    return runs_of_rank(p, dist.get_rank(process_group(p)))


def _layout_value(v):
    return tuple(v) if isinstance(v, list) else v  # a state dict may turn a tuple into a list


class BlockOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that computes on whole blocks of its params, sharded or not.

    Subclasses override :meth:`block_spec` and call :meth:`map_blocks` in ``step``. The constructor declares every
    param's blocks to the sharding layer (ragged units re-plan once, a collective: build the optimizer on every rank
    with the same params, before the first step); from the first step on the layouts are locked. Element-wise math
    runs on :func:`local` tensors as usual."""

    #: Instance attributes that are settings, not caches: ``pickle`` and ``copy.deepcopy`` keep them (torch's
    #: ``Optimizer.__getstate__`` keeps only defaults, state and param_groups). Subclasses add theirs.
    _settings_attrs: tuple[str, ...] = ("_block_allow_split",)
    #: Group hyperparameters that decide the blocks (and so the layout and the shape of the state): they cannot
    #: change between steps (checked at each step; a change raises before anything is updated), and state saved
    #: with other values does not load (:meth:`layout_difference`).
    layout_keys: tuple[str, ...] = ()
    #: Whether a block a rank holds whole may be computed by another rank, to balance :meth:`block_cost` over the
    #: ranks (its data then travels to that owner and its result back, each step). Worth it when a block's cost or
    #: state is not proportional to its elements (Shampoo's and SOAP's bands: factors of rows^2 and cols^2); off
    #: by default (the planner already spreads the elements evenly).
    balance_whole_blocks: bool = False
    #: State of ragged-sharded params is kept as this rank's local pieces (the step computes on ``local(p)``); the
    #: sharding layer's loaders hand torch's optimizers full-shape RaggedDTensor state instead, like their params.
    keeps_local_state = True
    #: ``state_dict`` / ``load_state_dict`` convert the state of ragged and FSDP2 params themselves, by the
    #: :meth:`state_schema` (the sharding layer's hooks for torch's optimizers leave this one alone).
    converts_own_state_dict = True

    def __init__(self, params, defaults: dict[str, Any], *, allow_split: bool = True) -> None:
        super().__init__(params, defaults)
        self._block_allow_split = allow_split
        self.declare_param_blocks()
        self._blocks_declared = True
        self.register_step_pre_hook(lambda opt, args, kwargs: opt._lock_block_layouts())
        self.register_step_post_hook(lambda opt, args, kwargs: opt._hold_block_state_keys())

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's; on a built optimizer the new group's blocks are declared at the next step (a collective, as the
        constructor's: every rank adds the same groups). Without that, a ragged unit's layout would not keep the new
        params' blocks whole, and their blocks cut by a rank boundary were silently computed in pieces."""
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        for i, p in enumerate(self.param_groups[gi]["params"]):
            if is_dtensor(p):
                try:
                    check_placements(p, f"{type(self).__name__}: param_groups[{gi}]['params'][{i}] with shape "
                                     f"{tuple(p.shape)}")  # fmt: skip
                except ValueError:
                    self.param_groups.pop()
                    raise
        if self.__dict__.get("_blocks_declared"):
            self._blocks_stale = True

    def state_schema(self, p: Tensor, group: dict[str, Any]) -> dict[str, StateKind]:
        """What each state entry of ``p`` (in ``group``) is: ``{key: ro.Elem() | ro.Blocks(spec, form=...) |
        ro.Replicated()}``; every save and load path reads it (docs/custom_optimizer.md, "State"). A key it leaves
        out takes the default: a tensor shaped like ``local(p)`` is ``Elem``, a 0-d tensor or a number
        ``Replicated``; other state under an undeclared key (a dict of per-block tensors) is refused at save.
        Override it when the state holds more than that; ``Blocks`` takes the param's own :meth:`block_spec`."""
        return {}

    def block_state_ranges(self, p: Tensor) -> list[list[tuple[int, int]]]:
        """Every rank's blocks of ``p`` that it computes, as flat element ranges ``[start, end)`` of the full param,
        in the order a ``Blocks(spec, form="value" | "element")`` state tensor holds them: the order of
        :meth:`blocks_computed_here` (AdamW8bit overrides it for its FSDP2 layout). One entry per rank of ``p``'s
        process group; a plain param's one rank computes every block."""
        cache = self.__dict__.setdefault("_block_state_ranges", {})
        if id(p) not in cache:
            spec = self._spec_of(p)
            numel = max(1, int(torch.Size(full_shape(p)).numel()))
            group = process_group(p)
            if group is None:
                cache[id(p)] = [[(0, numel)]]
            else:
                routed = self._routing(group).routed[id(p)]
                cache[id(p)] = [
                    _computed_spans(spec, runs_of_rank(p, r), numel, routed, r)
                    for r in range(dist.get_world_size(group))
                ]
        return cache[id(p)]

    @torch._disable_dynamo  # (bookkeeping; ``torch.compile(opt.step)`` traces the step hooks)
    def _block_dict_state_keys(self) -> list[tuple[Tensor, list[str]]]:
        """Each param's ``Blocks(..., form="dict")`` keys; reading them checks every param's schema (before the
        first step, so that a schema of the wrong type is an error before anything is updated)."""
        held = self.__dict__.get("_block_dict_keys")
        if held is None:
            held = []
            for g in self.param_groups:
                for p in g["params"]:
                    keys = [k for k, kind in declared_schema(self, p, g).items() if is_block_dict(kind)]
                    if keys:
                        held.append((p, keys))
            self._block_dict_keys = held
        return held

    @torch._disable_dynamo
    def _hold_block_state_keys(self) -> None:
        """After a step, every param that had a grad holds each ``Blocks(..., form="dict")`` key it declares (an
        empty dict on a rank that computes none of its blocks): torch's ``set_state_dict`` refuses a param without
        state ("Missing optimizer state for parameter"), and ``get_state_dict`` runs a step of its own on a rank
        whose state is empty (alone: a collective the others never join)."""
        for p, keys in self._block_dict_state_keys():
            if p.grad is not None:
                st = self.state[p]
                for k in keys:
                    st.setdefault(k, {})

    def state_dict(self) -> dict[str, Any]:
        """torch's, converted by :meth:`state_schema` from construction on (``optim/state_schema.py``): the
        element-wise state of ragged params as full-shape RaggedDTensors, of FSDP2 params as DTensors (as torch's
        optimizers keep it), per-block tensors as RaggedDTensors over the param's blocks, per-block dicts by block
        index. Raises a ValueError naming the key and the fix for state the schema does not cover or disagrees
        with. (Before, the hooks that do the first for torch's optimizers arrived at their first step: a state
        dict read right after a load held each rank's flat pieces, silently.)"""
        return state_to_dcp(self, super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, taking the state of ragged and FSDP2 params in any form :meth:`state_dict` and DCP give (full
        tensors, (Ragged)DTensors, this rank's pieces), before as after the first step; per-block dicts keep the
        blocks this rank computes."""
        super().load_state_dict(state_from_dcp(self, state_dict))

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update({k: self.__dict__[k] for k in self._settings_attrs if k in self.__dict__})
        return state

    def block_spec(self, p: Tensor, group: dict[str, Any]) -> BlockSpec | None:
        """The blocks ``p`` (in ``group``) is computed on; None (the default) for an element-wise param. Use the
        param's full shape (:func:`full_shape`): ``BlockSpec.rows(16, full_shape(p))``, ``BlockSpec.matrices(...)``,
        ``BlockSpec.elements(256, numel)``."""
        return None

    def block_cost(self, p: Tensor, spec: BlockSpec, numel: int) -> float:
        """What one of ``p``'s blocks of ``numel`` elements costs the rank that computes it (compute, or the state it
        keeps), to balance who computes which block: owner-computed and cut blocks, and whole blocks with
        :attr:`balance_whole_blocks`. Default: the Newton-Schulz cost ``m * n * min(m, n)`` of the block's matrix
        view (``numel`` for a 1-D run)."""
        return default_block_cost(full_shape(p), spec, numel)

    def declare_param_blocks(self) -> None:
        """(Re)declare every param's spec: called by the constructor, and by the next step after ``add_param_group``
        on a built optimizer. A collective when ragged units are concerned; after the first step a group whose
        blocks need another layout is refused (the layouts hold optimizer state by then)."""
        declare_blocks(
            [(p, s) for g in self.param_groups for p in g["params"] if (s := self.block_spec(p, g)) is not None],
            allow_split=self._block_allow_split,
            block_cost=self.block_cost,
            balance_whole_blocks=self.balance_whole_blocks,
            params=[p for g in self.param_groups for p in g["params"]],
        )
        caches = ("_block_routing", "_block_specs", "_block_state_ranges", "_state_schema_cache", "_block_dict_keys")
        for cache in caches:
            self.__dict__.pop(cache, None)
        self._declared_groups = len(self.param_groups)
        self.record_layout()

    def record_layout(self) -> None:
        """Remember each group's :attr:`layout_keys` values as the ones the blocks and state were made for."""
        self._layout_groups = [{k: g[k] for k in self.layout_keys if k in g} for g in self.param_groups]

    def layout_difference(self, groups: list[dict]) -> tuple[int, str, Any, Any] | None:
        """The first ``(group index, key, value in groups, value here)`` where ``groups`` (saved ones, or the ones
        recorded) differ from this optimizer's in a :attr:`layout_keys` hyperparameter both have; else None."""
        for gi, (g, mine) in enumerate(zip(groups, self.param_groups)):
            for k in self.layout_keys:
                if k in g and k in mine and _layout_value(g[k]) != _layout_value(mine[k]):
                    return gi, k, g[k], mine[k]
        return None

    def _check_layout_keys(self) -> None:
        """Refuse a change of a :attr:`layout_keys` hyperparameter since the last step (or the load): the blocks,
        the sharded layout and the optimizer state were made for the old value (unchecked: a torch-internal
        shape error deep in the step, a KeyError, or the old value silently kept)."""
        diff = self.layout_difference(self.__dict__.get("_layout_groups") or [])
        if diff is not None:
            gi, key, old, new = diff
            raise ValueError(
                f"{type(self).__name__}: param_groups[{gi}][{key!r}] changed from {old!r} to {new!r} after the "
                f"optimizer was built; {key} decides how the params are cut into blocks (the sharded layout and "
                f"the shape of the optimizer state follow it), so it is fixed for the optimizer's life. Set it "
                f"back, or build a new optimizer with {key}={new!r} (its state starts fresh)"
            )
        self.record_layout()  # (groups added since keep their values from here on)

    def _lock_block_layouts(self) -> None:
        if self.layout_keys:
            self._check_layout_keys()
        if self.__dict__.pop("_blocks_stale", False):  # groups were added (add_param_group) since the declaration
            try:
                self.declare_param_blocks()
            except (RuntimeError, ValueError) as e:  # refused on every rank alike: take the new groups back out
                del self.param_groups[self.__dict__.get("_declared_groups", len(self.param_groups)) :]
                raise type(e)(
                    f"{e}. The param groups added since the last step were removed: {type(self).__name__} is as "
                    "it was before add_param_group, and its next step runs without them"
                ) from e
            self._layouts_locked = False  # (the new params' units too)
        if not self.__dict__.get("_layouts_locked"):
            lock_layouts(p for g in self.param_groups for p in g["params"])
            self._layouts_locked = True
            self._block_dict_state_keys()

    def _spec_of(self, p: Tensor) -> BlockSpec:
        specs = self.__dict__.setdefault("_block_specs", {})
        if id(p) not in specs:
            group = next((g for g in self.param_groups if any(q is p for q in g["params"])), None)
            spec = self.block_spec(p, group) if group is not None else None
            if spec is None:
                raise ValueError(
                    f"map_blocks got a param of shape {tuple(full_shape(p))} for which block_spec returned None "
                    "(or that is not in this optimizer): give it a BlockSpec, or update it element-wise on local(p)"
                )
            specs[id(p)] = spec
        return specs[id(p)]

    def _routing(self, group) -> BlockRouting:
        routing = self.__dict__.setdefault("_block_routing", {})
        if id(group) not in routing:
            members = [
                (p, s)
                for g in self.param_groups
                for p in g["params"]
                if process_group(p) is group and (s := self.block_spec(p, g)) is not None
            ]
            cost = lambda p, s, n: self.block_cost(p, s, n)  # noqa: E731
            routing[id(group)] = BlockRouting(members, group, cost, self.balance_whole_blocks)
        return routing[id(group)]

    def blocks_computed_here(self, p: Tensor) -> list[int]:
        """The indices (:attr:`Block.index`) of ``p``'s blocks that :meth:`map_blocks` hands to ``fn`` on this rank
        (the blocks it holds whole, and the cut blocks it owns): where their per-block state lives. Checkpoints load
        each saved block's state on the rank this names."""
        spec = self._spec_of(p)
        group = process_group(p)
        routed = self._routing(group).routed[id(p)] if group is not None else []
        rank = dist.get_rank(group) if group is not None else 0
        numel = max(1, int(torch.Size(full_shape(p)).numel()))
        out = [spec.block_index(s) for s, _, r in routed if r is not None and r.owner == rank]
        skip = {s for s, _, _ in routed}
        for lo, hi, _ in _own_runs(p):
            out += [spec.block_index(s) for s, _ in _local_block_spans(spec, lo, hi, numel, skip)]
        return sorted(b + j for b in out for j in range(spec.tiles_per_block))

    def has_cut_blocks(self, p: Tensor) -> bool:
        """Whether :meth:`map_blocks` moves data between ranks for ``p`` (a block of it is cut by a rank boundary, or
        computed by an owner that does not hold it). Such params must reach ``map_blocks`` together, with the same
        params on every rank of their group; a param without cut blocks may also be mapped alone, each rank on its
        own (so that only one param's temporaries are alive at a time). The answer is the same on every rank."""
        group = process_group(p)
        return group is not None and bool(self._routing(group).routed.get(id(p)))

    def routed_numel_by_owner(self, p: Tensor) -> dict[tuple[int, int], int]:
        """Elements of ``p``'s cut blocks per owner, keyed ``(id(process group), owner rank)``: what
        :meth:`map_blocks` gathers to each owner for ``p``. The same answer on every rank (routes are global)."""
        group = process_group(p)
        out: dict[tuple[int, int], int] = {}
        if group is None:
            return out
        for _, _, route in self._routing(group).routed.get(id(p), ()):
            key = (id(group), route.owner)
            out[key] = out.get(key, 0) + route.numel
        return out

    def map_blocks(
        self,
        fn: Callable[[list[Block]], list[Tensor]],
        params: Sequence[Tensor],
        inputs: Sequence[Tensor | Sequence[Tensor]],
        *,
        out: Sequence[Tensor] | None = None,
        out_dtype: torch.dtype | None = None,
        local_blocks: bool | Sequence[bool] = True,
        wire_dtype: torch.dtype | str | None = None,
    ) -> list[Tensor]:
        """Run ``fn`` on every block of ``params`` that this rank computes, and put each block's result back where
        the block's elements live.

        ``inputs[k]``: a tensor, or a tuple of tensors, shaped like ``local(params[k])`` (a grad, a momentum
        buffer, the param itself). ``fn(blocks) -> results`` is called once, with every block this rank computes
        (:class:`Block`), and returns one tensor of ``block.numel`` elements per block. Blocks cut by a rank
        boundary are gathered to their owner first and their results scattered back: one ``all_to_all`` each way
        per process group for all of them (none when no block needs another rank's data). Returns, per param, a
        tensor shaped like ``local(params[k])`` holding the results: ``out[k]`` when given (results are written
        into it; a result that *is* the block's view of ``out[k]`` is not copied); else ``fn``'s own result when
        one block is the param's whole local tensor and the result has the output dtype (no copy), or a new tensor
        in ``out_dtype`` (default: the first input's dtype).
        ``local_blocks=False``: ``fn`` sees only the gathered blocks, and elements of blocks held whole are left as
        they are in ``out`` (a list of bools: per param).
        ``wire_dtype``: the dtype pieces travel in (default: the input's), or ``"int8"`` / ``"fp8_e4m3"``.

        A collective for distributed params: every rank of a group calls it with the same ``params``."""
        check_wire_dtype(wire_dtype, "map_blocks")
        params = list(params)
        inputs = [tuple(x) if isinstance(x, list | tuple) else (x,) for x in inputs]
        if len(inputs) != len(params) or (out is not None and len(out) != len(params)):
            raise ValueError(
                f"map_blocks: got {len(params)} params, {len(inputs)} inputs"
                + ("" if out is None else f" and {len(out)} outputs")
                + "; give one input (a tensor or a tuple of tensors) per param"
            )
        for p, xs in zip(params, inputs):
            self._spec_of(p)  # a param without a spec (or not in this optimizer) is refused here, on every rank
            n = local(p).numel()
            if any(t.numel() != n for t in xs):
                raise ValueError(
                    f"map_blocks: an input has {[t.numel() for t in xs]} elements for a param whose local tensor "
                    f"has {n}: inputs must be shaped like local(p)"
                )
        for k, o in enumerate(out or ()):  # (else a raw size mismatch from deep inside, naming nothing)
            n = local(params[k]).numel()
            if not isinstance(o, Tensor) or o.numel() != n:
                got = f"{o.numel()} elements" if isinstance(o, Tensor) else f"a {type(o).__name__}"
                raise ValueError(f"map_blocks: out[{k}] is {got} for a param whose local tensor has {n}: out must be "
                                 "shaped like local(p)")  # fmt: skip
        flats = [[t.reshape(-1) for t in xs] for xs in inputs]
        outs = _Outputs(params, flats, out, out_dtype)
        blocks: list[Block] = []
        sinks: list[tuple] = []  # per block: ("local", k, lo-relative start) or ("routed", group key, route index)
        exchanges, routed_starts = self._gather_cut_blocks(params, flats, wire_dtype, blocks, sinks)
        with_local = [local_blocks] * len(params) if isinstance(local_blocks, bool) else list(local_blocks)
        for k, p in enumerate(params):
            if with_local[k]:
                spec = self._spec_of(p)
                numel = max(1, int(torch.Size(full_shape(p)).numel()))
                for lo, hi, at in _own_runs(p):  # (one run, at 0, unless a DTensor's layout cuts its rows)
                    for s, e in _local_block_spans(spec, lo, hi, numel, routed_starts.get(k, set())):
                        shape = spec.block_shape(s, e)
                        vals = tuple(f[at + s - lo : at + e - lo].view(shape) for f in flats[k])
                        blocks.append(Block(p, spec.block_index(s), s, e, shape, vals, False))
                        sinks.append(("local", k, at + s - lo))
        if any(self._spec_of(p).tile_cols for p in params):
            blocks, sinks = _split_tiles(blocks, sinks, self._spec_of)
        results = fn(blocks) if blocks else []
        with torch.no_grad():  # a non-contiguous input was copied: in-place changes go back into it
            for xs, fs in zip(inputs, flats):
                for t, f in zip(xs, fs):
                    if not _shares_storage(t, f):
                        t.copy_(f.view(t.shape))
        if not isinstance(results, list | tuple) or not all(isinstance(r, Tensor) for r in results):
            what = type(results).__name__ if not isinstance(results, list | tuple) else "a list holding non-tensors"
            raise TypeError(f"map_blocks: fn must return a list of tensors, one per block, got {what}")
        if len(results) != len(blocks):
            raise ValueError(f"map_blocks: fn returned {len(results)} results for {len(blocks)} blocks")
        owned: dict[int, dict[int, Tensor]] = {key: {} for key in exchanges}
        for block, r, sink in zip(blocks, results, sinks):
            if r.numel() != block.numel:
                raise ValueError(
                    f"map_blocks: fn returned {r.numel()} elements for a block of {block.numel} (shape {block.shape})"
                )
            if sink[0] == "tile":  # into its band's result (a routed band's is made here, from its first tile)
                _, band, rows, cols, c0 = sink
                r = r.reshape(block.shape)
                if band[0] == "routed":
                    buf = owned[band[1]].get(band[2])
                    if buf is None:
                        buf = owned[band[1]][band[2]] = torch.empty(rows * cols, dtype=r.dtype, device=r.device)
                    buf.view(rows, cols)[:, c0 : c0 + r.shape[1]].copy_(r)
                else:
                    outs.put_tile(band[1], band[2], cols, c0, r)
            elif sink[0] == "routed":
                owned[sink[1]][sink[2]] = r.reshape(-1)
            else:
                outs.put(sink[1], sink[2], r)
        for key, (pg, ks, idx, scatter_x) in exchanges.items():
            dtype = functools.reduce(torch.promote_types, (outs.dtype(k) for k in ks))  # as for the gather
            back = scatter_x.scatter(owned[key], wire_dtype or dtype, dtype=dtype, device=flats[ks[0]][0].device)
            routed = self._routing(pg).routed
            for k, ris in zip(ks, idx):
                for ri, (s, e, _) in zip(ris, routed[id(params[k])]):
                    if ri in back:
                        outs.put(k, local_slice(params[k], s, e)[0], back[ri])
        return outs.finish()

    def _gather_cut_blocks(self, params, flats, wire_dtype, blocks: list, sinks: list) -> tuple[dict, dict]:
        """Gather the routed blocks of ``params`` to their owners (one all_to_all per process group) and append the
        ones this rank owns to ``blocks``. Returns the exchanges to scatter results back with, per group, and per
        param the starts of its routed blocks (not computed where they lie)."""
        by_group: dict[int, tuple[Any, list[int]]] = {}
        for k, p in enumerate(params):
            pg = process_group(p)
            if pg is not None:
                by_group.setdefault(id(pg), (pg, []))[1].append(k)
        exchanges: dict[int, tuple] = {}
        routed_starts: dict[int, set[int]] = {}
        for key, (pg, ks) in by_group.items():
            routed = self._routing(pg).routed
            n_inputs = len(flats[ks[0]])
            idx, gather_x, scatter_x = self._routing(pg).exchange([params[k] for k in ks], n_inputs)
            for k in ks:
                routed_starts[k] = {s for s, _, _ in routed[id(params[k])]}
            n_routes = len(scatter_x.routes)
            if not n_routes:
                continue
            # One dtype for the group's exchange that loses no input's precision (bf16 and fp32 grads: fp32); the same
            # on every rank, whichever pieces this one holds.
            dtype = functools.reduce(torch.promote_types, (f.dtype for k in ks for f in flats[k]))
            device = flats[ks[0]][0].device
            pieces: list[Tensor | None] = [None] * (n_routes * n_inputs)
            for k, ris in zip(ks, idx):
                for ri, (s, e, _) in zip(ris, routed[id(params[k])]):
                    a, b = local_slice(params[k], s, e)
                    if b > a:
                        for j, f in enumerate(flats[k]):
                            pieces[j * n_routes + ri] = f[a:b].to(dtype)
            full = gather_x.gather(pieces, wire_dtype or dtype, dtype=dtype, device=device)
            exchanges[key] = (pg, ks, idx, scatter_x)
            for k, ris in zip(ks, idx):
                spec = self._spec_of(params[k])
                for ri, (s, e, _) in zip(ris, routed[id(params[k])]):
                    if ri in full:
                        shape = spec.block_shape(s, e)
                        vals = tuple(full[j * n_routes + ri].view(shape) for j in range(n_inputs))
                        blocks.append(Block(params[k], spec.block_index(s), s, e, shape, vals, True))
                        sinks.append(("routed", key, ri))
        return exchanges, routed_starts


WIRE_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_wire_dtype(wire_dtype, where: str) -> None:
    """None, a floating dtype pieces are cast to, or a quantized format; an integer or bool dtype (a cast that
    truncates the values: Muon's updates came back zero or pointing elsewhere) is refused."""
    if wire_dtype is None or wire_dtype in WIRE_FLOAT_DTYPES or wire_dtype in ("int8", "fp8_e4m3"):
        return
    raise ValueError(
        f"{where}: wire_dtype must be None, one of {[str(d) for d in WIRE_FLOAT_DTYPES]}, or 'int8' / 'fp8_e4m3' "
        f"(block-quantized with a scale), got {wire_dtype!r}"
        + ("; for 8-bit transport pass the string 'int8'" if wire_dtype in (torch.int8, torch.uint8) else "")
    )


class _Outputs:
    """The per-param results of :meth:`BlockOptimizer.map_blocks`. Given ``out`` tensors are written into. Otherwise
    a param whose one block is its whole local tensor returns ``fn``'s result itself when it has the output dtype
    (no copy: a plain or owner-held matrix), and the others get a zero tensor in ``out_dtype`` or the first input's
    dtype (elements of a block nobody computes, a spec the layout was not planned for, stay 0)."""

    def __init__(self, params, flats, out, out_dtype=None) -> None:
        self.params, self.flats, self.given, self.out_dtype = params, flats, out is not None, out_dtype
        self.out = list(out) if out is not None else [None] * len(params)
        self.flat = [None if o is None else (o.view(-1) if o.is_contiguous() else o.reshape(-1)) for o in self.out]

    def dtype(self, k: int) -> torch.dtype:
        if self.given:
            return self.out[k].dtype
        return self.out_dtype or self.flats[k][0].dtype

    def put(self, k: int, offset: int, r: Tensor) -> None:
        n = r.numel()
        if self.flat[k] is None:
            whole = offset == 0 and n == self.flats[k][0].numel()
            as_asked = r.dtype == self.dtype(k)  # else cast, as a param of several blocks is: whatever the layout
            if whole and as_asked and not any(_shares_storage(r, f) for f in self.flats[k]):
                self.out[k] = r.reshape(local(self.params[k]).shape)
                self.flat[k] = self.out[k].reshape(-1)
                return
            self.out[k] = torch.zeros_like(local(self.params[k]), dtype=self.dtype(k))
            self.flat[k] = self.out[k].view(-1)
        dst = self.flat[k][offset : offset + n]
        if r.data_ptr() != dst.data_ptr():
            dst.copy_(r.reshape(-1))

    def put_tile(self, k: int, offset: int, cols: int, c0: int, r: Tensor) -> None:
        """A tile's result ``r`` (``[rows, w]``) into columns ``c0 .. c0 + w`` of the band of ``cols`` columns at
        ``offset`` of param k's output."""
        if self.flat[k] is None:
            self.out[k] = torch.zeros_like(local(self.params[k]), dtype=self.dtype(k))
            self.flat[k] = self.out[k].view(-1)
        rows, w = r.shape
        dst = self.flat[k][offset : offset + rows * cols].view(rows, cols)[:, c0 : c0 + w]
        if r.data_ptr() != dst.data_ptr() or r.stride() != dst.stride():
            dst.copy_(r)

    def finish(self) -> list[Tensor]:
        for k, o in enumerate(self.out):
            if o is None:
                self.out[k] = torch.zeros_like(local(self.params[k]), dtype=self.dtype(k))
            elif self.given and not o.is_contiguous():
                o.copy_(self.flat[k].view(o.shape))
        return self.out


def _shares_storage(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
