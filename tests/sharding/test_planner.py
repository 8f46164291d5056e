"""Properties of the RaggedShard planner (sharding/planner.py), drawn with hypothesis, plus bad-input messages."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ragged_optim.sharding.catalog import model_units
from ragged_optim.sharding.layout import BlockSpec, Layout
from ragged_optim.sharding.planner import TensorSpec, clear_plan_cache, layout_stats, plan_unit, rank_loads

# ---------------------------------------------------------------------------------------------------------------
# The checker: every invariant a Layout from plan_unit must satisfy.


def _ranks_to_check(layout: Layout, i: int) -> list[int]:
    """All ranks for small W; for large W the holders of tensor i, their neighbours, and the ends."""
    W = layout.world_size
    if W <= 512:
        return list(range(W))
    n = layout.numels[i]
    near = set(layout.ranks_of(i, 0, n)) if n else set()
    more = {r + d for r in list(near)[:1] + list(near)[-1:] for d in (-1, 1)} | {0, W - 1, W // 2}
    return sorted(r for r in near | more if 0 <= r < W)


def check_layout(layout: Layout, tensors: list[TensorSpec], W: int, alignment: int, allow_split: bool) -> None:
    itemsize = tensors[0].itemsize if tensors else layout.itemsize
    S = layout.shard_size
    q = max(1, alignment // itemsize)
    assert layout.world_size == W
    assert layout.names == tuple(t.name for t in tensors)
    assert layout.shapes == tuple(tuple(t.shape) for t in tensors)
    assert (S * itemsize) % alignment == 0
    assert len(layout.offsets) == len(tensors) == len(layout.owned_blocks)
    numels = layout.numels
    prev_end = 0
    for i, (off, n) in enumerate(zip(layout.offsets, numels)):
        assert off % q == 0, f"offset {off} of {layout.names[i]} not a multiple of {q}"
        if n == 0:
            assert layout.owned_blocks[i] == ()
            continue
        assert off >= prev_end, "tensor ranges must be ordered and disjoint"
        prev_end = off + n
    assert prev_end <= W * S

    for i, (t, n) in enumerate(zip(tensors, numels)):
        if n == 0:
            continue
        off, spec = layout.offsets[i], t.spec
        # Every element owned by exactly one rank: the local ranges tile [0, n) in rank order.
        covered = 0
        for r in _ranks_to_check(layout, i):
            lo, hi = layout.local_range(r, i)
            if hi > lo:
                assert lo == covered, f"rank {r}: range of {t.name} starts at {lo}, expected {covered}"
                covered = hi
        assert covered == n
        assert sum(hi - lo for lo, hi in (layout.local_range(r, i) for r in layout.ranks_of(i, 0, n))) == n
        owned = layout.owned_blocks[i]
        for ob in owned:
            assert 0 <= ob.owner < W
            assert 0 <= ob.start < ob.end <= n
        if spec.owner_computed:
            # Every block exactly once, in order, owner-computed ones never marked split.
            pos = 0
            for ob in owned:
                assert not ob.split
                assert (ob.start, ob.end) == spec.block_of(ob.start, n) and ob.start == pos
                pos = ob.end
            assert pos == n
            continue
        split = {(ob.start, ob.end) for ob in owned if ob.split}
        assert len(split) == len(owned), "a locally computed tensor owns only split blocks"
        if not allow_split:
            assert not owned, f"{t.name}: split blocks with allow_split=False"
        cut_blocks = set()
        for k in range(off // S + 1, (off + n - 1) // S + 1):
            p = k * S - off
            if not spec.is_boundary(p, n):
                cut_blocks.add(spec.block_of(p, n))
        assert cut_blocks == split, f"{t.name}: cut blocks {sorted(cut_blocks)} != split {sorted(split)}"
        for ob in owned:  # owner: the rank holding most of the block
            pieces = {
                r: min(off + ob.end, (r + 1) * S) - max(off + ob.start, r * S)
                for r in layout.ranks_of(i, ob.start, ob.end)
            }
            assert pieces[ob.owner] == max(pieces.values())


# ---------------------------------------------------------------------------------------------------------------
# Strategies.


@st.composite
def tensor_lists(draw, max_tensors: int = 6):
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    out = []
    for j in range(draw(st.integers(1, max_tensors))):
        ndim = draw(st.integers(1, 3))
        if ndim == 1:
            shape = (draw(st.integers(0, 3000)),)
        elif ndim == 2:
            shape = (draw(st.integers(1, 48)), draw(st.integers(1, 48)))
        else:
            shape = (draw(st.integers(1, 4)), draw(st.integers(1, 24)), draw(st.integers(1, 24)))
        n = math.prod(shape)
        kind = draw(st.sampled_from(["elements", "rows", "matrices", "custom"]))
        g = draw(st.sampled_from([1, 2, 3, 7, 16, 64, 256]))
        if kind == "elements":
            spec = BlockSpec.elements(g, n)
        elif kind == "rows":
            spec = BlockSpec.rows(g, shape)
        elif kind == "matrices":
            spec = BlockSpec.matrices(shape)
        else:
            spec = BlockSpec(block=draw(st.integers(1, 400)), period=draw(st.integers(1, 2000)))
        out.append(TensorSpec(f"t{j}", shape, itemsize, spec))
    return out


world_sizes = st.one_of(st.integers(1, 9), st.sampled_from([16, 33, 64, 127, 1024]), st.integers(1, 32768))
FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(tensors=tensor_lists(), W=world_sizes, alignment=st.sampled_from([1, 4, 16, 64]), allow_split=st.booleans())
def test_layout_invariants(tensors, W, alignment, allow_split):
    layout = plan_unit(tensors, W, alignment=alignment, allow_split=allow_split)
    check_layout(layout, tensors, W, alignment, allow_split)
    stats = layout_stats(layout)
    assert stats["padded_elements"] == W * layout.shard_size - sum(layout.numels)
    assert int(rank_loads(layout).sum()) == sum(layout.numels)
    if not allow_split:
        assert stats["split_blocks"] == 0


@FAST
@given(tensors=tensor_lists(), W=st.integers(1, 64), split_weight=st.sampled_from([0.0, 0.5, 1.0, 4.0]))
def test_split_weight_keeps_invariants(tensors, W, split_weight):
    layout = plan_unit(tensors, W, split_weight=split_weight)
    check_layout(layout, tensors, W, 16, True)


@settings(max_examples=60, deadline=None)
@given(W=st.integers(1, 40), k=st.integers(1, 4), r=st.integers(2, 24), c=st.integers(2, 24))
def test_whole_matrices_are_owned_where_they_lie(W, k, r, c):
    """Equal matrices, one per rank at most: every matrix lying whole on a rank is owned by that rank."""
    tensors = [TensorSpec(f"w{j}", (r, c), 4, BlockSpec.matrices((r, c))) for j in range(k * W)]
    layout = plan_unit(tensors, W)
    check_layout(layout, tensors, W, 16, True)
    for i in range(len(tensors)):
        (ob,) = layout.owned_blocks[i]
        holders = layout.ranks_of(i, 0, r * c)
        if len(holders) == 1:
            assert ob.owner == holders[0]
    # Equal costs: the holder preference never overloads a rank beyond k matrices, the balanced maximum.
    assert layout_stats(layout)["owner_compute_max_over_mean"] == pytest.approx(1.0)


def test_owner_computed_cuts_cost_nothing():
    # Muon-style unit: matrices are owner computed, so S stays at the lower bound whatever the cuts.
    shapes = [(512, 256), (64, 256), (64, 256), (256, 512), (1792, 256), (1792, 256), (256, 1792)]
    ts = [TensorSpec(f"m{j}", s, 4, BlockSpec.matrices(s)) for j, s in enumerate(shapes)]
    ts += [TensorSpec("norm", (256,), 4, BlockSpec.elements(16, 256))]
    for W in (8, 64, 1000):
        layout = plan_unit(ts, W)
        check_layout(layout, ts, W, 16, True)
        lower_bound = math.ceil(sum(layout.numels) / W / 4) * 4  # 16-byte aligned S of 4-byte elements
        assert layout.shard_size == lower_bound


def test_compute_load_balances_repeated_units():
    # 7 matrices per layer, 16 ranks: alone a layer leaves ranks idle; with compute_load the layers fill them in.
    shapes = [(64, 64), (16, 64), (16, 64), (64, 64), (224, 64), (224, 64), (64, 224)]
    load = np.zeros(16)
    for layer in range(40):
        ts = [TensorSpec(f"l{layer}.m{j}", s, 4, BlockSpec.matrices(s)) for j, s in enumerate(shapes)]
        layout = plan_unit(ts, 16, compute_load=load)
        check_layout(layout, ts, 16, 16, True)
    assert load.max() / load.mean() < 1.1
    single = plan_unit(ts, 16)
    assert layout_stats(single)["owner_compute_max_over_mean"] > 3
    with pytest.raises(ValueError, match=r"compute_load must have shape \(16,\)"):
        plan_unit(ts, 16, compute_load=np.zeros(3))


def test_expert_stack_blocks_do_not_cross_matrices():
    shape = (8, 96, 64)
    t = [TensorSpec("experts", shape, 2, BlockSpec.matrices(shape))]
    layout = plan_unit(t, 3)
    check_layout(layout, t, 3, 16, True)
    assert [(b.start, b.end) for b in layout.owned_blocks[0]] == [(j * 96 * 64, (j + 1) * 96 * 64) for j in range(8)]
    assert layout_stats(layout)["owner_compute_max_over_mean"] <= 1.2


# ---------------------------------------------------------------------------------------------------------------
# Edge cases and documented handling.


def test_empty_and_zero_size():
    layout = plan_unit([], 4)
    assert layout.shard_size == 0 and layout.offsets == ()
    ts = [
        TensorSpec("a", (0,), 4, BlockSpec.elements(4, 0)),
        TensorSpec("b", (10,), 4, BlockSpec.elements(4, 10)),
        TensorSpec("c", (0, 5), 4, BlockSpec.rows(2, (0, 5))),
    ]
    layout = plan_unit(ts, 3)
    check_layout(layout, ts, 3, 16, True)
    assert all(layout.local_range(r, 0) == (0, 0) for r in range(3))


def test_world_size_one_is_dense():
    ts = [TensorSpec(f"t{j}", (j + 5, 7), 4, BlockSpec.rows(2, (j + 5, 7))) for j in range(5)]
    layout = plan_unit(ts, 1)
    check_layout(layout, ts, 1, 16, True)
    assert layout.owned_blocks == ((),) * 5
    assert layout.shard_size - sum(layout.numels) < 4 * 5


def test_block_larger_than_tensor_is_the_whole_tensor():
    ts = [TensorSpec("a", (100,), 4, BlockSpec(block=10**6, period=10**6)), TensorSpec("b", (60,), 4, BlockSpec(7, 60))]
    for allow in (True, False):
        layout = plan_unit(ts, 4, allow_split=allow)
        check_layout(layout, ts, 4, 16, allow)


def test_no_split_falls_back_to_padding():
    ts = [TensorSpec("big", (1000,), 4, BlockSpec(1000, 1000))]
    layout = plan_unit(ts, 4, allow_split=False)
    check_layout(layout, ts, 4, 16, False)
    assert layout.ranks_of(0, 0, 1000) == range(0, 1) or len(layout.ranks_of(0, 0, 1000)) == 1


def test_cache_keeps_names_and_is_consistent():
    clear_plan_cache()
    a = [
        TensorSpec("l0.w", (64, 32), 4, BlockSpec.rows(4, (64, 32))),
        TensorSpec("l0.b", (64,), 4, BlockSpec.elements(4, 64)),
    ]
    b = [
        TensorSpec("l1.w", (64, 32), 4, BlockSpec.rows(4, (64, 32))),
        TensorSpec("l1.b", (64,), 4, BlockSpec.elements(4, 64)),
    ]
    la, lb = plan_unit(a, 5), plan_unit(b, 5)
    assert lb.names == ("l1.w", "l1.b") and la.names == ("l0.w", "l0.b")
    assert (la.shard_size, la.offsets, la.owned_blocks) == (lb.shard_size, lb.offsets, lb.owned_blocks)


# ---------------------------------------------------------------------------------------------------------------
# Bad input: clear messages naming the parameter and the fix.


def _t(name="w", shape=(4, 4), itemsize=4, spec=None):
    return TensorSpec(name, shape, itemsize, spec or BlockSpec.rows(1, shape))


@pytest.mark.parametrize(
    "tensors, kwargs, match",
    [
        ([_t()], {"world_size": 0}, r"world_size must be an int >= 1"),
        ([_t()], {"world_size": -3}, r"world_size"),
        ([_t()], {"world_size": 2, "alignment": 12}, r"alignment must be a power of two"),
        ([_t()], {"world_size": 2, "alignment": 0}, r"alignment"),
        ([_t(itemsize=0)], {"world_size": 2}, r"tensor 'w': itemsize must be an int >= 1"),
        ([_t("a"), _t("b", itemsize=2)], {"world_size": 2}, r"tensor 'b': itemsize 2 differs"),
        ([_t("a"), _t("a")], {"world_size": 2}, r"tensor 'a': duplicate name"),
        ([_t(shape=(4, -1), spec=BlockSpec(1, 1))], {"world_size": 2}, r"tensor 'w': shape must be non-negative"),
        ([_t()], {"world_size": 2, "split_weight": -1.0}, r"split_weight must be"),
        ([("w", (4,), 4)], {"world_size": 2}, r"TensorSpec"),
        ([TensorSpec("w", (4,), 4, "rows")], {"world_size": 2}, r"tensor 'w': spec must be a BlockSpec"),
    ],
)
def test_bad_input_messages(tensors, kwargs, match):
    W = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=match):
        plan_unit(tensors, W, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Quality regressions on catalog models (fast: one unit kind each, cached plans).


def _model_overhead(name: str, W: int, g: int, allow_split: bool = True) -> float:
    total = waste = 0
    for unit in model_units(name):
        ts = [TensorSpec(n, s, 4, BlockSpec.rows(g, s)) for n, s in unit.params]
        st_ = layout_stats(plan_unit(ts, W, allow_split=allow_split))
        total += st_["total_elements"]
        waste += st_["padded_elements"] + st_["split_elements"]
    return waste / total


@pytest.mark.parametrize("name", ["deepseek-v3", "gpt-oss-120b"])
@pytest.mark.parametrize("W", [64, 128, 256])
def test_moe_models_overhead_small(name, W):
    assert _model_overhead(name, W, 16) <= 0.02


def test_llama_no_split_matches_reference_point():
    # No-split at W=128, G=16 needs S to be a multiple of lcm(16*8192, 16*28672): about 10% padding.
    assert _model_overhead("llama3-70b", 128, 16, allow_split=False) <= 0.11


def test_joint_owner_assignment_balances_units_largest_first():
    from ragged_optim.sharding.planner import assign_owners_jointly, owner_compute_loads

    dims = (256, 1024, 256, 512, 512, 256, 768, 256, 1024, 256, 384)  # the Muon benchmark's chain of Linears
    shapes = [(dims[i + 1], dims[i]) for i in range(len(dims) - 1)]
    layouts = [
        plan_unit([TensorSpec(f"w{i}", s, 4, BlockSpec.matrices(s))], 4, compute_load=np.zeros(4))
        for i, s in enumerate(shapes)
    ]
    joint = assign_owners_jointly(layouts)
    load = sum(owner_compute_loads(lay) for lay in joint)
    assert load.max() / load.mean() <= 1.1
    assert [lay.offsets for lay in joint] == [lay.offsets for lay in layouts]  # only owners move


# ---------------------------------------------------------------------------------------------------------------
# layout_stats counts owner-computed blocks that are cut or moved (it used to skip owner-computed specs entirely,
# so a Muon plan reported no split bytes while matrices travelled to their owners).


def _owner_stats_by_element(layout: Layout) -> tuple[int, int, int]:
    """Reference: (cut, moved, moved elements) of owner-computed blocks from each element's rank, one by one."""
    cut = moved = moved_elems = 0
    S = layout.shard_size
    for i, (spec, blocks) in enumerate(zip(layout.specs, layout.owned_blocks)):
        if not spec.owner_computed:
            continue
        for b in blocks:
            ranks = [(layout.offsets[i] + e) // S for e in range(b.start, b.end)]
            away = sum(r != b.owner for r in ranks)
            cut += len(set(ranks)) > 1
            moved += away > 0
            moved_elems += away
    return cut, moved, moved_elems


def test_owner_computed_cut_and_moved_counted():
    """Three equal 8x8 Muon matrices on 2 ranks: S = 96 elements, so the boundary cuts the middle matrix in half.
    Fails on the old layout_stats (no owner_* keys: owner-computed specs were skipped)."""
    ts = [TensorSpec(f"m{j}", (8, 8), 4, BlockSpec.matrices((8, 8))) for j in range(3)]
    layout = plan_unit(ts, 2)
    assert layout.shard_size == 96 and layout.offsets == (0, 64, 128)
    st_ = layout_stats(layout)
    assert (st_["owner_blocks"], st_["owner_cut_blocks"]) == (3, 1)
    (mid,) = layout.owned_blocks[1]
    assert (mid.start, mid.end) == (0, 64) and layout.ranks_of(1, 0, 64) == range(0, 2)
    # The cut matrix has 32 elements on each rank: 32 travel to its owner, whichever it is.
    assert st_["owner_moved_elements"] >= 32 and st_["owner_moved_blocks"] >= 1
    assert (st_["owner_cut_blocks"], st_["owner_moved_blocks"], st_["owner_moved_elements"]) == (
        _owner_stats_by_element(layout)
    )
    assert st_["owner_moved_bytes_ratio"] == st_["owner_moved_elements"] / 192
    assert st_["split_blocks"] == 0  # split_* stays the locally-computed blocks' figure


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 12), st.integers(1, 12)), min_size=1, max_size=6),
    W=st.integers(1, 9),
    rows=st.booleans(),
)
def test_owner_stats_match_element_reference(shapes, W, rows):
    """Matrix stacks (owner-computed per matrix) mixed with a band-split tensor: the owner_* figures equal the
    element-by-element count, with the owners the layout holds."""
    ts = [TensorSpec(f"s{j}", s, 4, BlockSpec.matrices(s)) for j, s in enumerate(shapes)]
    if rows:
        ts.append(TensorSpec("bands", (10, 6), 4, BlockSpec.rows(3, (10, 6))))
    layout = plan_unit(ts, W)
    st_ = layout_stats(layout)
    assert st_["owner_blocks"] == sum(s[0] for s in shapes)
    assert (st_["owner_cut_blocks"], st_["owner_moved_blocks"], st_["owner_moved_elements"]) == (
        _owner_stats_by_element(layout)
    )
