"""The public block API (``ro.BlockOptimizer``, ``map_blocks``, ``all_reduce_over_shards``) with toy optimizers
defined here: on ragged-sharded and on torch FSDP2 DTensor params, at world sizes 1..6, each equals its one-process
run; every block's state lives on one rank; cut blocks move in one all_to_all each way; bad input is refused.

One group of ranks per drawn world size runs every drawn case (a spawn costs ~3 s per rank)."""

import math

import pytest
import torch
from fsdp_models import Mats
from fsdp_models import grads_for as full_grads
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from noise_bounds import assert_within_reference
from readme_blocks import _example
from torch import nn

import ragged_optim as ro
from ragged_optim.comm.counter import count_collectives
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.testing import ShardedMismatch, assert_sharded_matches_single, set_full_grad

# ------------------------------------------------------------------ toy optimizers, written as a user would


class BlockNormSGD(ro.BlockOptimizer):
    """``p -= lr * c * (G - mean_rows(G)) / ||G - mean_rows(G)||`` per block (bands of ``g`` rows, whole matrices,
    or runs of ``g`` elements), where ``c`` counts the steps each block has taken (per-block state). Matrices
    (``kind="matrices"``) take one Newton-Schulz step instead: ``X = G / ||G||``, ``1.5 X - 0.5 X X^T X``."""

    def __init__(self, params, lr=0.1, g=3, kind="rows", allow_split=True):
        super().__init__(params, dict(lr=lr, g=g, kind=kind), allow_split=allow_split)

    def block_spec(self, p, group):
        shape = ro.full_shape(p)
        if len(shape) < 2:
            return None  # 1-D params: element-wise
        if group["kind"] == "rows":
            return ro.BlockSpec.rows(group["g"], shape)
        if group["kind"] == "matrices":
            return ro.BlockSpec.matrices(shape)
        return ro.BlockSpec.elements(group["g"], math.prod(shape))

    def _block_update(self, b):
        counts = self.state[b.param].setdefault("count", {})
        counts[b.index] = counts.get(b.index, 0) + 1
        x = b.value.clone()  # a fresh tensor: reductions round the same wherever the block sits in a shard
        if x.ndim == 2 and self._kind == "matrices":
            x = x / (x.norm() + 1e-12)
            return 1.5 * x - 0.5 * (x @ x.T) @ x
        if x.ndim == 2:
            x = x - x.mean(dim=0, keepdim=True)
        return counts[b.index] * x / (x.norm() + 1e-12)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            self._kind = group["kind"]
            blocked = [p for p in group["params"] if p.grad is not None and self.block_spec(p, group) is not None]
            updates = self.map_blocks(
                lambda blocks: [self._block_update(b) for b in blocks], blocked, [ro.local(p.grad) for p in blocked]
            )
            for p, u in zip(blocked, updates):
                ro.local(p).add_(u, alpha=-group["lr"])
            for p in group["params"]:
                if p.grad is not None and self.block_spec(p, group) is None:
                    ro.local(p).add_(ro.local(p.grad), alpha=-group["lr"])


class GlobalNormSGD(torch.optim.Optimizer):
    """``p -= lr * g / ||g||`` with the norm of the whole grad: ``all_reduce_over_shards`` on any kind of param."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = ro.local(p.grad)
                    norm = ro.all_reduce_over_shards(g.double().square().sum(), p).sqrt()
                    ro.local(p).add_(g / norm.to(g.dtype), alpha=-group["lr"])


# ------------------------------------------------------------------ models, grads, runs


def set_grads(model, shapes, step, seed):
    for p, g in zip(model.ordered(), full_grads(shapes, step, seed)):
        set_full_grad(p, g)


def make_opt(model, case):
    if case["kind"] == "global_norm":
        return GlobalNormSGD(model.parameters())
    return BlockNormSGD(model.parameters(), g=case["g"], kind=case["kind"], allow_split=case["allow_split"])


def run_case(model, case, steps=3):
    opt = make_opt(model, case)
    calls = []
    for step in range(steps):
        set_grads(model, case["shapes"], step, case["seed"])
        with count_collectives() as stats:
            opt.step()
        calls.append(dict(stats.calls))
    blocks = sorted((i, k) for i, p in enumerate(model.ordered()) for k in opt.state[p].get("count", {}))
    return calls, blocks


def one_process(case, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = Mats(case["shapes"], case["seed"])
        _, blocks = run_case(model, case)
        return [p.detach().clone() for p in model.ordered()], blocks
    finally:
        torch.set_num_threads(before)


def ranks_run(rank, world_size, cases, fsdp2):
    out = []
    for case in cases:
        model = Mats(case["shapes"], case["seed"])
        if fsdp2:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard as torch_fully_shard

            torch_fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
        else:
            ro.fully_shard(model)
        calls, blocks = run_case(model, case)
        params = [p.full_tensor() if hasattr(p, "full_tensor") else ro.full_tensor(p) for p in model.ordered()]
        out.append(([t.detach().clone() for t in params], calls, blocks))
    return out


def max_rel(a, b):
    return max(((x - y).abs().max() / y.abs().max().clamp(min=1e-30)).item() for x, y in zip(a, b))


shape_st = st.one_of(
    st.tuples(st.integers(1, 20), st.integers(1, 20)),
    st.tuples(st.integers(1, 3), st.integers(1, 8), st.integers(1, 6)),  # a stack of matrices
)
case_st = st.fixed_dictionaries(
    {
        "shapes": st.lists(shape_st, min_size=1, max_size=3),
        "kind": st.sampled_from(["rows", "matrices", "elements", "global_norm"]),
        "g": st.integers(1, 7),
        "allow_split": st.booleans(),
        "seed": st.integers(0, 99),
    }
)


def check_cases(cases, world_size, fsdp2):
    results = run_on_ranks(ranks_run, world_size, cases, fsdp2)
    for c, case in enumerate(cases):
        ref, ref_blocks = one_process(case, 1)  # the ranks run one thread each
        gap = max_rel(one_process(case, torch.get_num_threads())[0], ref)  # what the thread count alone changes
        what = f"{case} on {world_size} {'FSDP2' if fsdp2 else 'ragged'} ranks"
        assert_within_reference(max_rel(results[0][c][0], ref), gap, 1.0, what)
        owners = [b for r in results for b in r[c][2]]
        assert sorted(owners) == ref_blocks, f"{what}: each block's state must live on exactly one rank"
        for r in results:
            for calls in r[c][1]:
                assert calls.get("all_to_all", 0) <= 2, f"{what}: {calls}"  # cut blocks: one gather, one scatter


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases=st.lists(case_st, min_size=3, max_size=5), world_size=st.integers(1, 6))
def test_ragged_block_views_match_one_process(cases, world_size):
    check_cases(cases, world_size, fsdp2=False)


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases=st.lists(case_st, min_size=3, max_size=5), world_size=st.integers(2, 6))
def test_fsdp2_block_views_match_one_process(cases, world_size):
    check_cases(cases, world_size, fsdp2=True)


def test_cut_matrices_gathered_in_one_exchange():
    """Matrices over 3 ranks: some cut by a rank boundary, gathered to one owner each, in one all_to_all each way
    per step; the same optimizer without declared blocks (a per-piece update) is caught as a mismatch."""
    shapes = [(7, 5), (9, 4), (6, 6)]
    case = dict(shapes=shapes, kind="matrices", g=1, allow_split=True, seed=3)
    results = run_on_ranks(ranks_run, 3, [case], True)
    assert all(calls.get("all_to_all", 0) == 2 for r in results for calls in r[0][1])
    check_cases([case], 3, fsdp2=True)


class NoDeclaration(BlockNormSGD):
    """The same update computed on whatever piece of each grad a rank holds: no block declared."""

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                x = ro.local(p.grad).clone()
                ro.local(p).add_(x / (x.norm() + 1e-12), alpha=-group["lr"])


def test_leaving_the_declaration_out_is_caught():
    with pytest.raises(ShardedMismatch, match="differs from the one-process run"):
        assert_sharded_matches_single(
            lambda: Mats([(6, 4)], 0), lambda m: NoDeclaration(m.parameters()), world_size=2, steps=1
        )


def test_bad_input_is_refused():
    w = nn.Parameter(torch.randn(4, 3))

    class BadSpec(BlockNormSGD):
        def block_spec(self, p, group):
            return (2, 6)

    with pytest.raises(TypeError, match=r"shape \(4, 3\) must be a ragged_optim.BlockSpec"):
        BadSpec([w])
    opt = BlockNormSGD([w, nn.Parameter(torch.randn(3))])
    with pytest.raises(ValueError, match="got 1 params, 2 inputs"):
        opt.map_blocks(lambda b: [x.value for x in b], [w], [w.detach(), w.detach()])
    with pytest.raises(ValueError, match=r"shape \(3,\) for which block_spec returned None"):
        opt.map_blocks(lambda b: [x.value for x in b], [opt.param_groups[0]["params"][1]], [torch.zeros(3)])
    with pytest.raises(ValueError, match="inputs must be shaped like local"):
        opt.map_blocks(lambda b: [x.value for x in b], [w], [torch.zeros(5)])
    with pytest.raises(ValueError, match="fn returned 0 results for 2 blocks"):
        opt.map_blocks(lambda b: [], [w], [torch.zeros(4, 3)])
    # before: "object of type 'NoneType' has no len()", "'list' object has no attribute 'numel'" and "The size of
    # tensor a (3) must match the size of tensor b (12)", none naming what was wrong
    with pytest.raises(TypeError, match="fn must return a list of tensors, one per block, got NoneType"):
        opt.map_blocks(lambda b: None, [w], [torch.zeros(4, 3)])
    with pytest.raises(TypeError, match="fn must return a list of tensors, one per block, got a list holding"):
        opt.map_blocks(lambda b: [[x.value] for x in b], [w], [torch.zeros(4, 3)])
    with pytest.raises(ValueError, match=r"out\[0\] is 3 elements for a param whose local tensor has 12"):
        opt.map_blocks(lambda b: [x.value for x in b], [w], [torch.zeros(4, 3)], out=[torch.zeros(3)])
    for kw in (
        {"block": "4", "period": 8},
        {"block": 4.0, "period": 8},
        {"block": 4, "period": 8, "owner_computed": "no"},
    ):
        with pytest.raises(TypeError, match="BlockSpec (block|owner_computed) must be"):  # (4.0 failed in the planner)
            ro.BlockSpec(**kw)
    with pytest.raises(ValueError, match="op must be one of"):
        ro.all_reduce_over_shards(torch.zeros(1), w, op="avg")


def test_block_geometry():
    spec = ro.BlockSpec.rows(3, (2, 7, 5))  # a stack of two 7 x 5 matrices, bands of 3 rows
    assert spec.row_len == 5 and spec.block_shape(35, 50) == (3, 5) and spec.block_shape(65, 70) == (1, 5)
    assert [spec.block_index(s) for s in (0, 15, 30, 35, 50, 65)] == [0, 1, 2, 3, 4, 5]
    assert ro.BlockSpec.matrices((8, 2, 3, 3)).block_shape(0, 144) == (8, 18)  # conv: [out, in * k * k]
    assert ro.BlockSpec.elements(4, 10).block_shape(8, 10) == (2,)
    # row_len is a view hint: it does not change the layout, so it does not change equality
    assert ro.BlockSpec(15, 35) == ro.BlockSpec.rows(3, (7, 5))


@pytest.mark.parametrize("path,name", [("docs/custom_optimizer.md", "MuonLite"), ("README.md", "BandSign")])
def test_docs_example_matches_one_process_on_ragged_and_fsdp2(path, name):
    example = _example(path, name)

    def fsdp2(model):
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        torch_fully_shard(model)

    model_fn = lambda: Mats([(7, 5), (2, 4, 3)], 1)  # noqa: E731
    for shard_fn in (None, fsdp2):
        assert_sharded_matches_single(
            model_fn,
            lambda m: example(m.parameters()),
            world_size=3,
            steps=2,
            rtol=1e-5,
            atol=1e-6,
            shard_fn=shard_fn,
        )


def _mixed_dtypes(rank, world_size, fsdp2):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 7, bias=False).to(torch.bfloat16), nn.Linear(4, 7, bias=False))
    grads = [torch.randn(7, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    if fsdp2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model:
            torch_fully_shard(layer, mesh=mesh)
    opt = BlockNormSGD(model.parameters(), g=2, kind="rows")
    for p, g in zip(model.parameters(), grads):
        set_full_grad(p, g)
    opt.step()
    return [(p.full_tensor() if fsdp2 else p).detach().float().clone() for p in model.parameters()]


def test_mixed_dtypes_exchange_in_the_widest():
    """A bf16 and an fp32 matrix in one process group (FSDP2 row chunks of 3 over 3 ranks cut 2-row bands):
    the fp32 matrix's cut bands must travel in fp32. They travelled in the first param's dtype (bf16) before: off by
    bf16 rounding (1e-4 after one step) where the one-process run is exact."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = _mixed_dtypes(0, 1, False)
    finally:
        torch.set_num_threads(threads)
    got = run_on_ranks(_mixed_dtypes, 3, True)[0]
    for a, b in zip(got, ref):
        assert torch.equal(a, b), (a - b).abs().max()


class _Rows2(ro.BlockOptimizer):
    def __init__(self, params):
        super().__init__(params, dict(lr=1.0))

    def block_spec(self, p, group):
        return ro.BlockSpec.rows(2, ro.full_shape(p))


def test_in_place_changes_land_in_a_non_contiguous_input():
    """``Block.values`` of a block held whole are views: in-place changes land in the input. Before, a
    non-contiguous input (a transposed buffer) was copied and the changes were silently lost."""
    p = torch.zeros(6, 4, requires_grad=True)
    opt = _Rows2([p])

    def zero(blocks):
        for b in blocks:
            b.value.mul_(0)
        return [b.value for b in blocks]

    for buf in (torch.ones(6, 4), torch.ones(4, 6).t()):
        opt.map_blocks(zero, [p], [buf])
        assert bool((buf == 0).all()), buf.is_contiguous()


def test_out_dtype_holds_whatever_the_blocks_are():
    """Before: with one block the whole local tensor, ``fn``'s result came back as is, ignoring ``out_dtype`` (bf16
    here); with two blocks it was float64: the dtype depended on the layout."""
    for rows in (4, 2):
        p = torch.zeros(4, 4, requires_grad=True)

        class Opt(_Rows2):
            def block_spec(self, p, group, rows=rows):
                return ro.BlockSpec.rows(rows, ro.full_shape(p))

        out = Opt([p]).map_blocks(
            lambda bs: [b.value.to(torch.bfloat16) for b in bs], [p], [torch.ones(4, 4)], out_dtype=torch.float64
        )
        assert out[0].dtype == torch.float64, rows


def test_default_out_dtype_is_the_first_inputs_whatever_the_blocks_are():
    """Without ``out_dtype`` the results come in the first input's dtype (the docs' "cast to the output's dtype").
    Before, a param whose one block was its whole local tensor got ``fn``'s float64 result back as is, one cut into
    several blocks a float32 tensor: which one depended on the layout, so ``p.add_(u)`` rounded differently sharded
    and on one process."""
    for rows in (4, 2):
        p = torch.zeros(4, 4, requires_grad=True)

        class Opt(_Rows2):
            def block_spec(self, p, group, rows=rows):
                return ro.BlockSpec.rows(rows, ro.full_shape(p))

        out = Opt([p]).map_blocks(lambda bs: [b.value.double() * 2 for b in bs], [p], [torch.ones(4, 4)])
        assert out[0].dtype == torch.float32, rows
        assert torch.equal(out[0], torch.full((4, 4), 2.0))
