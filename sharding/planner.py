"""The RaggedShard planner: lays the tensors of one FSDP unit into a flat buffer of ``W * S`` elements.

Problem (see docs/planner.md): tensors keep their given order, each is one contiguous range starting at an aligned
offset, rank k owns ``[k*S, (k+1)*S)``. A rank boundary that falls strictly inside a locally-computed block either
costs padding (shift the tensor so the boundary lands on a block boundary) or marks the block *split* (an owner
computes it). We minimise ``padding / total + split_weight * split_elements / total``.

Algorithm, for speed and quality:

1. Candidate shard sizes S: the lower bound, a small grid above it, and multiples of the block moduli of the large
   tensors (and their LCMs), which are the S values that put every cut of a long tensor on a block boundary.
2. For each S (ascending, stopping once the padding alone exceeds the best overhead found), a beam search over the
   tensors in order: each state is (end position, split cost); each tensor tries a handful of start shifts (none,
   the shift that puts its first cuts on the previous block boundary, the most common such shift over all its
   cuts, the next rank boundary). States are pruned to a Pareto front of (end, cost). Cut costs are computed with
   arithmetic on block boundaries, one value per rank boundary, never per block.
3. Owners of owner-computed blocks (Muon matrices): :func:`~ragged_optim.sharding.owner_balance.balance_owners`
   (longest-processing-time greedy) on Newton-Schulz cost ``m * n * min(m, n)``, preferring the rank that holds the
   largest piece of the matrix while its load stays under ``(1 + slack) * max(mean load, largest block)``. Split
   blocks start on the rank holding most of them. An optimizer re-balances the blocks it declares with its own
   ``block_cost`` (:func:`assign_owners_jointly`), split blocks and, if it asks, whole blocks included.

Plans are cached per (shapes, specs, itemsize, W, alignment, options): transformer layers repeat.

Input rules: ``world_size >= 1``; ``alignment`` a power of two (bytes); all tensors of a unit share one
``itemsize >= 1`` (one flat buffer has one dtype); names must be unique. A block (or period) larger than its tensor
is clamped to the tensor (the whole tensor is one block). Zero-size tensors occupy nothing: their offset is the
aligned position where they would start and they own no blocks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .layout import BlockSpec, Layout, OwnedBlock
from .owner_balance import balance_owners, default_block_cost

__all__ = ["TensorSpec", "plan_unit", "layout_stats", "rank_loads", "owner_compute_loads", "clear_plan_cache"]

_BEAM = 8  # states kept per tensor in the placement search
_GRID = (0.0, 0.0005, 0.001, 0.002, 0.004, 0.007, 0.01, 0.015, 0.02, 0.03, 0.045, 0.07, 0.1)
_CACHE: dict = {}
_CACHE_MAX = 512


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a unit: its name, shape, bytes per element and the blocks its optimizer needs whole."""

    name: str
    shape: tuple[int, ...]
    itemsize: int
    spec: BlockSpec


@dataclass(frozen=True)
class _Item:
    n: int  # numel
    b: int  # effective block: min(block, period)
    p: int  # period
    local: bool  # a locally-computed spec: cuts cost split elements
    need_after: int  # minimal span the tensors after this one need (from an aligned position)
    last: bool

    @property
    def regular(self) -> bool:
        """Block boundaries are exactly the multiples of b (and n): cut costs have a closed form."""
        return self.p % self.b == 0 or self.p >= self.n


def clear_plan_cache() -> None:
    _CACHE.clear()


def _align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def _s_quantum(itemsize: int, alignment: int) -> int:
    """Smallest S step with S * itemsize a multiple of alignment."""
    return alignment // math.gcd(alignment, itemsize)


def _validate(tensors: Sequence[TensorSpec], world_size: int, alignment: int, split_weight: float) -> int:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1 (the number of ranks), got {world_size!r}")
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two in bytes (e.g. 16), got {alignment!r}")
    if not (split_weight >= 0 and math.isfinite(split_weight)):
        raise ValueError(f"split_weight must be a finite number >= 0, got {split_weight!r}")
    itemsize = None
    seen = set()
    for t in tensors:
        if not isinstance(t, TensorSpec):
            raise ValueError(f"plan_unit takes TensorSpec items, got {type(t).__name__}: wrap it in TensorSpec(...)")
        if t.name in seen:
            raise ValueError(f"tensor {t.name!r}: duplicate name in one unit; names must be unique (rename it)")
        seen.add(t.name)
        if not isinstance(t.itemsize, int) or t.itemsize < 1:
            raise ValueError(f"tensor {t.name!r}: itemsize must be an int >= 1 (bytes per element), got {t.itemsize!r}")
        if itemsize is None:
            itemsize = t.itemsize
        elif t.itemsize != itemsize:
            raise ValueError(
                f"tensor {t.name!r}: itemsize {t.itemsize} differs from {itemsize} of the unit's first tensor; "
                "one unit is one flat buffer of one dtype: put tensors of other dtypes in another unit"
            )
        if any((not isinstance(d, int)) or d < 0 for d in t.shape):
            raise ValueError(f"tensor {t.name!r}: shape must be non-negative ints, got {t.shape!r}")
        if not isinstance(t.spec, BlockSpec):
            raise ValueError(f"tensor {t.name!r}: spec must be a BlockSpec, got {type(t.spec).__name__}")
    return itemsize or 1


# ---------------------------------------------------------------------------------------------------------------
# Cut costs: arithmetic on block boundaries.


def _cut_cost(p: int, it: _Item) -> int:
    """Elements of the block that a cut at tensor position p (0 < p < n) splits, 0 on a block boundary."""
    r = p % it.p
    ph = r % it.b
    if ph == 0:
        return 0
    bs = p - ph
    return min(bs + it.b, p - r + it.p, it.n) - bs


def _cut_costs_np(p: np.ndarray, it: _Item) -> np.ndarray:
    r = p % it.p
    ph = r % it.b
    bs = p - ph
    size = np.minimum(np.minimum(bs + it.b, p - r + it.p), it.n) - bs
    return np.where(ph == 0, 0, size)


def _count_congruent(k0: int, k1: int, a: int, c: int, m: int) -> int:
    """How many k in [k0, k1] satisfy k * a == c (mod m)."""
    g = math.gcd(a, m)
    if c % g:
        return 0
    m //= g
    if m == 1:
        return k1 - k0 + 1
    k = (c // g) * pow(a // g, -1, m) % m
    first = k0 + (k - k0) % m
    return 0 if first > k1 else (k1 - first) // m + 1


def _cost_at(start: int, it: _Item, S: int) -> int:
    """Split elements when the tensor starts at ``start``: closed form for regular specs, else one value per cut."""
    k0 = start // S + 1
    k1 = (start + it.n - 1) // S
    if k1 < k0 or not it.local:
        return 0  # owner-computed blocks are gathered whole wherever they lie: cuts cost no split bytes
    if k1 - k0 < 8:
        return sum(_cut_cost(k * S - start, it) for k in range(k0, k1 + 1))
    if it.regular:
        b, n = it.b, it.n
        cost = b * (k1 - k0 + 1 - _count_congruent(k0, k1, S % b, start % b, b))
        tail = n % b
        if tail:  # cuts inside the short last block cost its size, not b
            lo = (start + n - tail) // S + 1
            cost -= (b - tail) * max(0, k1 - lo + 1)
        return cost
    p = np.arange(k0, k1 + 1, dtype=np.int64) * S - start
    return int(_cut_costs_np(p, it).sum())


def _prev_boundaries(p: int, it: _Item):
    """Block boundaries at or before tensor position p, nearest first (finite, ends with 0)."""
    base = p - p % it.p
    b = base + ((p - base) // it.b) * it.b
    while b > 0:
        yield b
        if b > base:
            b -= it.b
        else:
            base -= it.p
            b = base + ((it.p - 1) // it.b) * it.b
    yield 0


def _aligned_shift_start(cut: int, p: int, it: _Item, q: int) -> int | None:
    """A start that puts the cut (absolute position ``cut``, tensor position p) on a block boundary, q-aligned."""
    for i, b in enumerate(_prev_boundaries(p, it)):
        start = cut - b
        if start % q == 0:
            return start
        if i > q:
            return None
    return None


def _candidates(s0: int, it: _Item, S: int, q: int) -> list[int]:
    k0 = s0 // S + 1
    k1 = (s0 + it.n - 1) // S
    out = [s0]
    if k1 < k0 or not it.local:
        return out
    m = k1 - k0 + 1
    for k in range(k0, min(k1, k0 + 3) + 1):
        st = _aligned_shift_start(k * S, k * S - s0, it, q)
        if st is not None:
            out.append(st)
    if k0 * S % q == 0:
        out.append(k0 * S)  # start on the next rank boundary
    if m > 4 and not it.regular:  # regular specs: every phase of the cycle is equally common
        p = np.arange(k0, k1 + 1, dtype=np.int64) * S - s0
        ph = (p % it.p) % it.b
        ph = ph[ph > 0]
        if ph.size:
            vals, counts = np.unique(ph, return_counts=True)
            for j in np.argsort(-counts, kind="stable")[:2]:
                st = s0 + int(vals[j])
                if st % q == 0:
                    out.append(st)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Placement for one S: beam search over tensors in order.


def _place(items: list[_Item], S: int, W: int, q: int, allow_split: bool):
    """Best (split cost, starts) for shard size S, or None when nothing fits."""
    cap = W * S
    states = [(0, 0, None)]  # (end, split cost, (start, parent node))
    for it in items:
        new = []
        memo: dict[int, int] = {}
        for end, cost, node in states:
            s0 = _align_up(end, q)
            c0 = memo.get(s0)
            if c0 is None:
                c0 = memo[s0] = _cost_at(s0, it, S)
            cands = [s0] if c0 == 0 else _candidates(s0, it, S, q)
            for st in sorted(set(cands)):
                e = st + it.n
                if (e if it.last else _align_up(e, q) + it.need_after) > cap:
                    continue
                c = memo.get(st)
                if c is None:
                    c = memo[st] = _cost_at(st, it, S)
                if c and not allow_split:
                    continue
                new.append((e, cost + c, (st, node)))
                if c == 0:
                    break  # a later (larger) start that is also free is dominated
        if not new:
            return None
        new.sort(key=lambda s: (s[0], s[1]))
        front = []
        best = None
        for s in new:
            if best is None or s[1] < best:
                front.append(s)
                best = s[1]
        if len(front) > _BEAM:
            keep = sorted(front[1:], key=lambda s: s[1])[: _BEAM - 1]
            front = [front[0], *sorted(keep, key=lambda s: s[0])]
        states = front
    end, cost, node = min(states, key=lambda s: (s[1], s[0]))
    starts = []
    while node is not None:
        starts.append(node[0])
        node = node[1]
    starts.reverse()
    return cost, starts


def _moduli(items: list[_Item], s_min: int) -> list[int]:
    """Block moduli of the tensors that rank boundaries cut often, heaviest first."""
    weight: dict[int, int] = {}
    for it in items:
        if not it.local or it.b >= it.n or it.b == 1 or it.n * 4 < s_min:
            continue
        weight[it.b] = weight.get(it.b, 0) + it.n
        if it.p % it.b and it.p < it.n:
            weight[it.p] = weight.get(it.p, 0) + it.n
    return [m for m, _ in sorted(weight.items(), key=lambda kv: -kv[1])][:6]


def _s_candidates(items: list[_Item], s_min: int, s_quant: int, s_all: int) -> list[int]:
    """Shard sizes worth trying, ascending: a grid above the lower bound, LCM-multiples of the block moduli of
    the tensors that rank boundaries cut often, a geometric ladder up to ``s_all`` (which never cuts anything)."""
    cands = {_align_up(math.ceil(s_min * (1 + e)), s_quant) for e in _GRID}
    cands.update(s_min + s_quant * (1 << j) for j in range(12))  # just above the bound: slack for a few shifts
    cands.add(s_all)
    mods = _moduli(items, s_min)
    lcms = set()
    for mask in range(1, 1 << len(mods)):
        lc = s_quant
        for j, m in enumerate(mods):
            if mask >> j & 1:
                lc = math.lcm(lc, m)
        lcms.add(lc)
    for m in mods:
        if m % 2 == 0:
            lcms.add(math.lcm(s_quant, m // 2))
    for lc in lcms:
        s = _align_up(s_min, lc)
        for k in range(3):
            cands.add(s + k * lc)
    steps = {s_quant, max((lc for lc in lcms if lc <= s_all), default=s_quant)}
    for step in steps:
        s = s_min
        while s < s_all:
            s = _align_up(math.ceil(s * 1.1), step)
            cands.add(s)
    return sorted(c for c in cands if s_min <= c <= s_all)


def _plan_offsets(items: list[_Item], W: int, q: int, s_quant: int, allow_split: bool, split_weight: float):
    n_total = sum(it.n for it in items)
    span = sum(_align_up(it.n, q) for it in items[:-1]) + items[-1].n
    s_min = _align_up(-(-span // W), s_quant)
    s_all = _align_up(span, s_quant)  # everything on rank 0: nothing is cut, so this always fits
    if W == 1:
        return s_min, _place(items, s_min, W, q, allow_split)[1]
    best = None  # (overhead, S, starts)
    for S in _s_candidates(items, s_min, s_quant, s_all):
        pad = (W * S - n_total) / n_total
        if best is not None and pad >= best[0]:
            break
        res = _place(items, S, W, q, allow_split)
        if res is None:
            continue
        over = pad + split_weight * res[0] / n_total
        if best is None or over < best[0]:
            best = (over, S, res[1])
    assert best is not None, "internal: the everything-on-one-rank layout did not fit"
    return best[1], best[2]


# ---------------------------------------------------------------------------------------------------------------
# Owned blocks: split blocks and owner-computed blocks.


def _holder(off: int, a: int, b: int, S: int) -> int:
    """The rank holding the most of global range [off+a, off+b) (lowest such rank)."""
    lo, hi = off + a, off + b
    r0, r1 = lo // S, (hi - 1) // S
    if r0 == r1:
        return r0
    first = (r0 + 1) * S - lo
    if r1 - r0 >= 2 and S >= first and S >= hi - r1 * S:
        return r0 + 1 if S > first else r0
    return r0 if first >= hi - r1 * S else r1


def _owned_blocks(items_all: list[_Item], S: int, offsets: list[int]):
    """Split blocks (owner: the rank holding most of the block) and every owner-computed block (owner provisional,
    set by _assign_owners)."""
    owned: list[list[OwnedBlock]] = [[] for _ in items_all]
    for i, it in enumerate(items_all):
        n, off = it.n, offsets[i]
        if n == 0:
            continue
        if not it.local:
            for base in range(0, n, it.p):
                pend = min(base + it.p, n)
                owned[i].extend(OwnedBlock(a, min(a + it.b, pend), -1, False) for a in range(base, pend, it.b))
            continue
        k0, k1 = off // S + 1, (off + n - 1) // S
        if k1 < k0:
            continue
        p = np.arange(k0, k1 + 1, dtype=np.int64) * S - off
        last = -1
        for pos in p[_cut_costs_np(p, it) > 0].tolist():
            r = pos % it.p
            bs = pos - r % it.b
            be = min(bs + it.b, pos - r + it.p, n)
            if bs == last:
                continue  # a block larger than S: one entry
            last = bs
            owned[i].append(OwnedBlock(bs, be, _holder(off, bs, be, S), True))
    return tuple(tuple(x) for x in owned)


def _candidates_of(layout: Layout, tag, cost, tensors, whole: bool) -> list[tuple]:
    """``(cost, key, holder)`` of every block of ``layout`` whose owner is to be balanced; key = ``(tag, tensor index,
    block start, block end)``. Owner-computed blocks and split blocks always; with ``whole`` also every block of a
    locally-computed spec that one rank holds whole (it may be computed elsewhere for balance). ``tensors``: the
    tensor indices to balance (None: all)."""
    S = layout.shard_size
    out = []
    for i, (shape, spec, blocks) in enumerate(zip(layout.shapes, layout.specs, layout.owned_blocks)):
        if tensors is not None and i not in tensors:
            continue
        off, n = layout.offsets[i], math.prod(shape)
        spans = [(b.start, b.end) for b in blocks if spec.owner_computed or b.split]
        if whole and not spec.owner_computed and n:
            cut = {s for s, _ in spans}
            start = 0
            while start < n:
                s, e = spec.block_of(start, n)
                if s not in cut:
                    spans.append((s, e))
                start = e
            spans.sort()
        for s, e in spans:
            c = cost(t=tag, i=i, shape=shape, spec=spec, numel=e - s)
            out.append((c, (tag, i, s, e), _holder(off, s, e, S)))
    return out


def _balanced(comp: list[tuple], load: np.ndarray) -> dict:
    """Owners of the candidate blocks ``comp`` over ranks already carrying ``load`` (updated in place), as
    ``{(tag, tensor index): [(start, end, owner), ...]}``."""
    owners = balance_owners([c[0] for c in comp], range(len(load)), [c[2] for c in comp], load=load)
    out: dict = {}
    for (_, (tag, i, s, e), _), o in zip(comp, owners):
        out.setdefault((tag, i), []).append((s, e, o))
    return out


def _with_owners(layout: Layout, owners: dict, tag) -> Layout:
    """``layout`` with the balanced owners: owner-computed and split blocks take theirs; a whole block of a
    locally-computed spec given to another rank than its holder is listed (``split=False``), the others stay local."""
    S = layout.shard_size
    owned = []
    for i, blocks in enumerate(layout.owned_blocks):
        listed = {(b.start, b.end): b for b in blocks}
        mine = owners.get((tag, i))
        if not mine:
            owned.append(tuple(blocks))
            continue
        for s, e, o in mine:
            b = listed.get((s, e))
            if b is not None:
                listed[(s, e)] = OwnedBlock(s, e, o, b.split)
            elif o != _holder(layout.offsets[i], s, e, S):
                listed[(s, e)] = OwnedBlock(s, e, o, False)
        owned.append(tuple(listed[k] for k in sorted(listed)))
    return dataclasses.replace(layout, owned_blocks=tuple(owned))


def _default_cost(t, i, shape, spec, numel) -> float:
    return default_block_cost(shape, spec, numel)


def _assign_owners(layout: Layout, load: np.ndarray) -> Layout:
    comp = _candidates_of(layout, 0, _default_cost, None, False)
    comp = [c for c in comp if layout.specs[c[1][1]].owner_computed]
    if not comp:
        return layout
    return _with_owners(layout, _balanced(comp, load), 0)


def assign_owners_jointly(
    layouts: Sequence[Layout],
    *,
    block_cost=None,
    tensors: Sequence[set[int] | None] | None = None,
    balance_whole_blocks: bool = False,
) -> list[Layout]:
    """Re-assign who computes the blocks of several units that share one process group, largest first over all
    of them with :func:`~ragged_optim.sharding.owner_balance.balance_owners` (planning unit by unit with a running
    load places each unit's large matrices before the next unit's, which balances worse). Data placement is
    unchanged; only who computes moves.

    Balanced: owner-computed blocks and split blocks (each preferring the rank holding most of it), and with
    ``balance_whole_blocks`` every whole block of a locally-computed spec too (moved off its holder only when that
    rank is over the cap: then its data travels each step). ``block_cost(t=, i=, shape=, spec=, numel=)``: the cost
    of a block of tensor ``i`` of ``layouts[t]`` (default: :func:`~ragged_optim.sharding.owner_balance.
    default_block_cost`). ``tensors[t]``: the tensor indices of ``layouts[t]`` to balance (None: all); the others
    keep their owners."""
    layouts = list(layouts)
    cost = block_cost or _default_cost
    comp = []
    for t, lay in enumerate(layouts):
        sel = None if tensors is None else tensors[t]
        comp.extend(_candidates_of(lay, t, cost, sel, balance_whole_blocks))
    if not comp:
        return layouts
    owners = _balanced(comp, np.zeros(layouts[0].world_size))
    return [_with_owners(lay, owners, t) for t, lay in enumerate(layouts)]


# ---------------------------------------------------------------------------------------------------------------
# Public API.


def plan_unit(
    tensors: Sequence[TensorSpec],
    world_size: int,
    *,
    alignment: int = 16,
    allow_split: bool = True,
    split_weight: float = 1.0,
    compute_load: np.ndarray | None = None,
) -> Layout:
    """Plan one FSDP unit: choose S and tensor offsets, mark split blocks, assign owners. See the module doc.

    ``compute_load`` (optional, float array of ``world_size``): owner compute already placed on each rank by earlier
    units of the same model. Owners are then balanced on top of it and it is updated in place, so identical layers
    spread their matrices over all ranks instead of repeating one assignment.
    """
    tensors = list(tensors)
    itemsize = _validate(tensors, world_size, alignment, split_weight)
    key = (
        tuple((tuple(t.shape), t.spec) for t in tensors),
        itemsize,
        world_size,
        alignment,
        bool(allow_split),
        float(split_weight),
    )
    names = tuple(t.name for t in tensors)
    if compute_load is not None and np.shape(compute_load) != (world_size,):
        raise ValueError(
            f"compute_load must have shape ({world_size},) (one value per rank), got {np.shape(compute_load)}"
        )
    layout = _CACHE.get(key)
    if layout is None:
        layout = _plan(tensors, world_size, itemsize, alignment, allow_split, split_weight)
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.clear()
        _CACHE[key] = layout
    if compute_load is not None:
        layout = _assign_owners(layout, compute_load)
    return dataclasses.replace(layout, names=names)


def _plan(tensors, W, itemsize, alignment, allow_split, split_weight) -> Layout:
    q = max(1, alignment // itemsize)
    s_quant = _s_quantum(itemsize, alignment)
    shapes = tuple(tuple(t.shape) for t in tensors)
    specs = tuple(t.spec for t in tensors)
    numels = [math.prod(s) for s in shapes]
    live = [i for i, n in enumerate(numels) if n > 0]
    need = [0] * len(tensors)
    acc = 0
    for j, i in enumerate(reversed(live)):
        need[i] = acc
        acc += numels[i] if j == 0 else _align_up(numels[i], q)
    items_all = []
    for i, (n, sp) in enumerate(zip(numels, specs)):
        p = max(1, min(sp.period, n)) if n else 1
        b = max(1, min(sp.block, p))
        items_all.append(_Item(n, b, p, not sp.owner_computed, need[i], bool(live) and i == live[-1]))
    offsets = [0] * len(tensors)
    if not live:
        return Layout(W, 0, itemsize, tuple(t.name for t in tensors), shapes, specs, tuple(offsets), ((),) * len(specs))
    S, starts = _plan_offsets([items_all[i] for i in live], W, q, s_quant, allow_split, split_weight)
    for i, st in zip(live, starts):
        offsets[i] = st
    cur = 0
    last_aligned = (W * S // q) * q
    for i in range(len(tensors)):
        if numels[i]:
            cur = offsets[i] + numels[i]
        else:
            offsets[i] = min(_align_up(cur, q), last_aligned)
    owned = _owned_blocks(items_all, S, offsets)
    layout = Layout(W, S, itemsize, tuple(t.name for t in tensors), shapes, specs, tuple(offsets), owned)
    return _assign_owners(layout, np.zeros(W))


def rank_loads(layout: Layout) -> np.ndarray:
    """Real (non-padding) elements per rank, shape [W]."""
    W, S = layout.world_size, layout.shard_size
    if S == 0:
        return np.zeros(W, dtype=np.int64)
    offs = np.asarray(layout.offsets, dtype=np.int64)
    ns = np.asarray(layout.numels, dtype=np.int64)
    order = np.argsort(offs, kind="stable")
    offs, ns = offs[order], ns[order]
    cum = np.concatenate([[0], np.cumsum(ns)])
    x = np.arange(W + 1, dtype=np.int64) * S
    j = np.searchsorted(offs, x, side="right") - 1
    jj = np.clip(j, 0, len(offs) - 1)
    f = np.where(j < 0, 0, cum[jj] + np.clip(x - offs[jj], 0, ns[jj]))
    return np.diff(f)


def owner_compute_loads(layout: Layout) -> np.ndarray:
    """Newton-Schulz cost m*n*min(m, n) of the owner-computed blocks each rank owns, shape [W]."""
    load = np.zeros(layout.world_size, dtype=np.float64)
    for shape, spec, blocks in zip(layout.shapes, layout.specs, layout.owned_blocks):
        if not spec.owner_computed:
            continue
        for ob in blocks:
            load[ob.owner] += default_block_cost(tuple(shape), spec, ob.end - ob.start)
    return load


def _owner_piece(layout: Layout, i: int, block: OwnedBlock) -> int:
    """Elements of ``block`` (of tensor i) that its owner holds: the part that does not travel."""
    lo, hi = layout.local_range(block.owner, i)
    return max(0, min(hi, block.end) - max(lo, block.start))


def layout_stats(layout: Layout) -> dict:
    """Quality figures of one plan: padding, split blocks, owner-computed blocks that are cut or moved, per-rank
    load and owner compute balance.

    ``split_*`` counts locally-computed blocks a rank boundary cuts (``OwnedBlock.split``). Owner-computed blocks
    (Muon's whole matrices) are counted apart, with the owners the layout holds: ``owner_cut_blocks`` are the ones
    a rank boundary cuts, ``owner_moved_blocks`` the ones whose owner does not hold them whole (every cut one, plus
    whole ones given to another rank for balance), ``owner_moved_elements`` the elements of those that are not on
    their owner (what travels to the owner and back each step).
    """
    total = sum(layout.numels)
    padded = layout.total_size - total
    split_blocks = split_elems = 0
    owner_blocks = owner_cut = owner_moved = owner_moved_elems = 0
    for i, (spec, blocks) in enumerate(zip(layout.specs, layout.owned_blocks)):
        if not spec.owner_computed:  # (whole blocks listed only because another rank computes them are not split)
            split_blocks += sum(1 for b in blocks if b.split)
            split_elems += sum(b.end - b.start for b in blocks if b.split)
            continue
        owner_blocks += len(blocks)
        for b in blocks:
            n = b.end - b.start
            owner_cut += len(layout.ranks_of(i, b.start, b.end)) > 1
            away = n - _owner_piece(layout, i, b)
            owner_moved += away > 0
            owner_moved_elems += away
    loads = rank_loads(layout)
    comp = owner_compute_loads(layout)
    mean = total / layout.world_size if layout.world_size else 0
    cmean = comp.sum() / layout.world_size
    return {
        "world_size": layout.world_size,
        "shard_size": layout.shard_size,
        "total_elements": total,
        "padded_elements": padded,
        "padding_ratio": padded / total if total else 0.0,
        "split_blocks": split_blocks,
        "split_elements": split_elems,
        "split_bytes_ratio": split_elems / total if total else 0.0,
        "owner_blocks": owner_blocks,
        "owner_cut_blocks": owner_cut,
        "owner_moved_blocks": owner_moved,
        "owner_moved_elements": owner_moved_elems,
        "owner_moved_bytes_ratio": owner_moved_elems / total if total else 0.0,
        "load_max_over_mean": float(loads.max() / mean) if total else 0.0,
        "owner_compute_max_over_mean": float(comp.max() / cmean) if cmean > 0 else None,
    }
