"""2-D tile blocks (issue 34, item 2): ``BlockSpec.tiles(tr, tc, shape)`` hands an optimizer ``tr x tc`` tiles of
each matrix (of each matrix of a stack), short last tiles where a size does not divide its dim; sharded (ragged and
FSDP2 params, 1..6 ranks) every tile is computed once, on one rank, bit for bit as in one process; per-tile state
in the declared ``Blocks`` layout reshards exactly (saved at 3 ranks, loaded at 2 and 1).

On main ``BlockSpec`` has no tiles (``AttributeError``): a tile optimizer had to take bands of rows and cut its
tiles itself, and on FSDP2 params a cut block was a whole band."""

import os

import pytest
import torch
from fsdp_models import Mats, grads_for
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from tile_norm import SAVE_AT, TOTAL, TileNorm, assert_bitwise, canonical, snapshot, train
from tile_norm import build as build_net
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

import ragged_optim as ro
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.testing import assert_sharded_matches_single, set_full_grad


class TileAbsMax(ro.BlockOptimizer):
    """Per tile: momentum ``m = 0.9 m + g`` (kept per tile, a dict under ``"tiles"``) and the step
    ``p -= lr * m / max|m|`` (absmax scaling, the per-tile rule of block-wise 8-bit and FP8 formats). Records
    every tile it is handed: ``(param index, tile index, shape, origin)``."""

    def __init__(self, params, tr, tc, lr=0.1):
        self.seen = []
        super().__init__(params, dict(lr=lr, tr=tr, tc=tc))

    def block_spec(self, p, group):
        shape = ro.full_shape(p)
        return ro.BlockSpec.tiles(group["tr"], group["tc"], shape) if len(shape) >= 2 else None

    def state_schema(self, p, group):
        spec = self.block_spec(p, group)
        return {"tiles": ro.Blocks(spec)} if spec is not None else {}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            mats = [p for p in group["params"] if p.grad is not None and self.block_spec(p, group) is not None]
            index = {id(p): i for i, p in enumerate(group["params"])}

            def per_tile(blocks, index=index):
                out = []
                for b in blocks:
                    self.seen.append((index[id(b.param)], b.index, b.shape, b.tile))
                    m = self.state[b.param].setdefault("tiles", {}).setdefault(b.index, torch.zeros(b.shape))
                    m.mul_(0.9).add_(b.value)
                    out.append(m / (m.abs().amax() + 1e-12))
                return out

            for p, u in zip(mats, self.map_blocks(per_tile, mats, [ro.local(p.grad) for p in mats])):
                ro.local(p).add_(u, alpha=-group["lr"])
            for p in group["params"]:
                if p.grad is not None and self.block_spec(p, group) is None:
                    ro.local(p).add_(ro.local(p.grad), alpha=-group["lr"])


def run_case(model, case, steps=3):
    opt = TileAbsMax(model.ordered(), case["tr"], case["tc"])
    for step in range(steps):
        for p, g in zip(model.ordered(), grads_for(case["shapes"], step, case["seed"])):
            set_full_grad(p, g)
        opt.step()
    tiles = {(i, k): (shape, origin) for i, k, shape, origin in opt.seen}
    held = sorted((i, k) for i, p in enumerate(model.ordered()) for k in opt.state[p].get("tiles", {}))
    full = [p.full_tensor() if hasattr(p, "full_tensor") else ro.full_tensor(p) for p in model.ordered()]
    return [t.detach().clone() for t in full], tiles, held


def expected_tiles(case) -> dict:
    """Every tile of every matrix, computed here from the shapes alone: ``(param, index) -> (shape, origin)``."""
    out = {}
    for i, shape in enumerate(case["shapes"]):
        *stack, rows, cols = shape
        n_mats = 1
        for d in stack:
            n_mats *= d
        tr, tc = case["tr"], case["tc"]
        k = 0
        for _ in range(n_mats):
            for r0 in range(0, rows, tr):
                for c0 in range(0, cols, tc):
                    out[(i, k)] = ((min(tr, rows - r0), min(tc, cols - c0)), (r0, c0))
                    k += 1
    return out


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
        out.append(run_case(model, case))
    return out


shape_st = st.one_of(
    st.tuples(st.integers(1, 17), st.integers(1, 17)),
    st.tuples(st.integers(1, 3), st.integers(1, 9), st.integers(1, 7)),  # a stack of matrices
)
case_st = st.fixed_dictionaries(
    {
        "shapes": st.lists(shape_st, min_size=1, max_size=3),
        "tr": st.integers(1, 6),
        "tc": st.integers(1, 6),
        "seed": st.integers(0, 99),
    }
)


# (no shrinking: each example forks up to 6 ranks; the failing case is printed whole)
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck), phases=list(Phase)[:4])
@given(cases=st.lists(case_st, min_size=2, max_size=3), world_size=st.integers(1, 6), fsdp2=st.booleans())
def test_tiles_match_one_process(cases, world_size, fsdp2):
    """Each tile is handed whole, ``tr x tc`` (short at the right and bottom edges), at its place; sharded runs
    equal the one-process run bit for bit (absmax and element-wise math: no rounding-order freedom), every tile's
    state on exactly one rank."""
    if fsdp2 and world_size == 1:
        fsdp2 = False  # (FSDP2 on one rank is a plain run: the ragged side covers W=1)
    results = run_on_ranks(ranks_run, world_size, cases, fsdp2)
    for c, case in enumerate(cases):
        ref, ref_tiles, ref_held = run_case(Mats(case["shapes"], case["seed"]), case)
        assert ref_tiles == expected_tiles(case), f"{case}: tiles handed in one process"
        what = f"{case} on {world_size} {'FSDP2' if fsdp2 else 'ragged'} ranks"
        for got, want in zip(results[0][c][0], ref):
            assert torch.equal(got, want), f"{what}: params differ from the one-process run"
        held = sorted(t for r in results for t in r[c][2])
        assert held == ref_held, f"{what}: each tile's state must live on exactly one rank"
        for r in results:
            for key, geometry in r[c][1].items():
                assert geometry == ref_tiles[key], f"{what}: tile {key} handed as {geometry}"


def test_tile_geometry_and_bad_input():
    spec = ro.BlockSpec.tiles(3, 2, (2, 7, 5))  # two 7 x 5 matrices; bands of 3 rows, tiles 2 columns wide
    assert spec.tiles_per_block == 3 and spec.tile_columns() == [(0, 2), (2, 2), (4, 1)]  # a short last tile
    assert spec == ro.BlockSpec(15, 35, row_len=5, tile_cols=2) and spec != ro.BlockSpec.rows(3, (2, 7, 5))
    assert [spec.block_index(s) for s in (0, 15, 30, 35)] == [0, 3, 6, 9]  # indices count tiles
    from ragged_optim.sharding.state_schema import n_blocks

    assert n_blocks(spec, 70) == 18
    assert ro.BlockSpec.tiles(4, 9, (6, 5)).tile_columns() == [(0, 5)]  # a tile wider than the matrix: clamped
    with pytest.raises(ValueError, match="tile_cols must be an int >= 1, got 0"):
        ro.BlockSpec.tiles(2, 0, (4, 4))
    with pytest.raises(ValueError, match="tile_rows must be an int >= 1"):
        ro.BlockSpec.tiles(2.5, 2, (4, 4))
    with pytest.raises(ValueError, match=r"shape \(8,\) has no rows and columns to tile.*BlockSpec.elements"):
        ro.BlockSpec.tiles(2, 2, (8,))
    with pytest.raises(ValueError, match="needs blocks of whole rows.*BlockSpec.tiles"):
        ro.BlockSpec(block=7, period=35, row_len=5, tile_cols=2)


# ----------------------------------------------------------------------------------------------- resharding


class TiledNorm(TileNorm):
    """test_state_schema's optimizer on 3 x 4 tiles instead of bands of 4 rows: per-tile dicts under ``"tiles"``,
    one peak per tile (``Blocks(spec, form="value")``), element-wise momentum for vectors."""

    def block_spec(self, p, group):
        return ro.BlockSpec.tiles(3, 4, ro.full_shape(p)) if len(ro.full_shape(p)) == 2 else None


def tiles_reference(_rank, _world):
    model, opt = build_net("plain", cls=TiledNorm)
    train(model, opt, 0, SAVE_AT)
    state = canonical(model, opt)
    train(model, opt, SAVE_AT, TOTAL)
    return state, snapshot(model)


def tiles_save(rank, world, root, kind):
    model, opt = build_net(kind, cls=TiledNorm)
    train(model, opt, 0, SAVE_AT)
    state = canonical(model, opt)
    ro.save_checkpoint(os.path.join(root, "ro"), model, [opt], extra={"step": SAVE_AT})
    full = (ro.get_full_state_dict(model), ro.get_full_optimizer_state_dict(model, opt))
    return (state, full) if rank == 0 else None


def tiles_load(rank, world, root, kind, full):
    out = {}
    for how in ("ro", "full"):
        model, opt = build_net(kind, cls=TiledNorm)
        if how == "ro":
            assert ro.load_checkpoint(os.path.join(root, "ro"), model, [opt]) == {"step": SAVE_AT}
        else:
            set_model_state_dict(model, full[0], options=StateDictOptions(full_state_dict=True))
            opt.load_state_dict(full[1])
        state = canonical(model, opt)
        train(model, opt, SAVE_AT, TOTAL)
        out[how] = (state, snapshot(model))
    return out if rank == 0 else None


@pytest.mark.parametrize("kind", ["ours", "fsdp2"])
def test_tile_state_reshards(tmp_path, kind):
    """Per-tile state saved at 3 ranks, loaded at 2 and at 1 (and into a plain model): the state right after the
    load and the params two steps later equal the run that never stopped, bit for bit."""
    want_state, want_params = run_on_ranks(tiles_reference, 1)[0]
    assert {"a.weight/tiles/8/m", "a.weight/peak/11", "b.weight/tiles/5/n"} <= set(want_state)  # 4 x 3 tiles
    root = str(tmp_path)
    state, full = run_on_ranks(tiles_save, 3, root, kind)[0]
    assert_bitwise(state, want_state, f"{kind} at 3 ranks vs one process")
    for target, world in ((kind, 2), ("ours", 1), ("plain", 1)):
        for how, (got_state, got_params) in run_on_ranks(tiles_load, world, root, target, full)[0].items():
            what = f"{kind} at 3 ranks -> {target} at {world} via {how}"
            assert_bitwise(got_state, want_state, f"{what}: the state right after the load")
            assert_bitwise(got_params, want_params, f"{what}: the params {TOTAL - SAVE_AT} steps later")


def test_docs_tile_example_matches_one_process():
    """The tile optimizer of docs/custom_optimizer.md, as written, at 3 ranks (ragged, then FSDP2): tiles of 2 x 2
    over matrices of 7 x 5 and a stack of 2 x 4 x 3 (short last tiles in both dims)."""
    from readme_blocks import _example

    example = _example("docs/custom_optimizer.md", "TileAbsMax")

    def fsdp2(model):
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        torch_fully_shard(model)

    for shard_fn in (None, fsdp2):
        assert_sharded_matches_single(
            lambda: Mats([(7, 5), (2, 4, 3)], 1),
            lambda m: example(m.parameters(), lr=0.1, tile=2),
            world_size=3,
            steps=2,
            rtol=0,
            atol=0,
            shard_fn=shard_fn,
        )
