"""Our optimizers on torch FSDP2 + TP DTensor params on 2-D and 3-D meshes (issue 36, item 1).

A 2-layer MLP parallelized by torch's own ``parallelize_module`` (up colwise, down rowwise) and sharded by torch's
``fully_shard`` over the dp dim (HSDP over (rep, dp) for the 3-D mesh) gets params placed ``(_StridedShard(0, sf=2),
Shard(0))``, ``(Shard(0), Shard(1))``, ``(Shard(0), Replicate())`` (with a leading ``Replicate()`` on the 3-D mesh),
of shapes (7, 6), (5, 7) that no mesh dim divides. Every optimizer steps on them and ends bitwise equal to the same
optimizer on one process on the full tensors (each rank runs that reference itself, with the same one thread), with
every block computed by exactly one rank of the whole mesh and one all_to_all each way per step. In the same runs,
torch.optim.AdamW on the same FSDP2 + TP params is the runtime's control, and torch.optim.Muon the peer. On main
(212c331) every optimizer here refused these params: ``ValueError: ... supports DTensor params sharded Shard(0) on
a 1-D mesh``."""

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import ragged_optim as ro
from ragged_optim.comm.counter import count_collectives
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.testing import default_grad, set_full_grad

MESH_DIMS = {2: ("dp", "tp"), 3: ("rep", "dp", "tp")}
STEPS = 3


class MLP(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.up = nn.Linear(6, 7)
        self.down = nn.Linear(7, 5)


class BandNorm(ro.BlockOptimizer):
    """A user's block optimizer: each band of 2 rows (runs of 4 elements for vectors) steps along its grad
    normalized over the band, which needs the band whole."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    def block_spec(self, p, group):
        return ro.BlockSpec.rows(2, ro.full_shape(p))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            ps = [p for p in g["params"] if p.grad is not None]
            outs = self.map_blocks(lambda bs: [b.value / (b.value.norm() + 1e-12) for b in bs], ps,
                                   [ro.local(p.grad) for p in ps])  # fmt: skip
            for p, o in zip(ps, outs):
                ro.local(p).add_(o.view(ro.local(p).shape), alpha=-g["lr"])


OPTIMIZERS = {
    "muon": lambda ps: ro.Muon(ps, lr=0.05, weight_decay=0.1, adamw_lr=0.01),
    "adamw8bit": lambda ps: ro.AdamW8bit(ps, lr=0.01, block_size=4, min_8bit_size=0),
    "shampoo": lambda ps: ro.Shampoo(ps, lr=0.01, max_preconditioner_dim=3),
    "soap": lambda ps: ro.SOAP(ps, lr=0.01, max_preconditioner_dim=3, precondition_frequency=1),
    "block_optimizer": lambda ps: BandNorm(ps),
}
PEERS = {
    "torch_adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01),
    "torch_muon": lambda ps: torch.optim.Muon([p for p in ps if p.ndim == 2], lr=0.05),
}


def tp_fsdp(model, mesh, sharder="torch"):
    """torch's 2-D (or HSDP + TP 3-D) recipe, as a user writes it, with torch's ``fully_shard`` or ours."""
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    shard = fully_shard if sharder == "torch" else ro.fully_shard
    shard(model, mesh=mesh["rep", "dp"] if mesh.ndim == 3 else mesh["dp"])
    return model


def make_mesh(shape):
    return init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIMS[len(shape)])


def set_grads(model, step):
    for n, p in model.named_parameters():
        set_full_grad(p, default_grad(step, n, p.shape))


def train(model, opt, steps, first=0):
    calls = []
    for step in range(first, first + steps):
        set_grads(model, step)
        with count_collectives() as stats:
            opt.step()
        calls.append(stats.calls.get("all_to_all", 0))
    return calls


def full(model) -> dict:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def run_layout(rank, world, shape, sharder):
    from ragged_optim.sharding.dtensor_layout import dtensor_layout

    mesh = make_mesh(shape)
    out = {"layout_ok": True}
    # (torch.optim.Muon's matrix ops need whole matrices: on our ragged params they are refused, naming full_tensor)
    peers = PEERS if sharder == "torch" else {"torch_adamw": PEERS["torch_adamw"]}
    for name, make in {**OPTIMIZERS, **peers}.items():
        ref = MLP()
        ref_opt = make(list(ref.parameters()))
        train(ref, ref_opt, STEPS)
        model = tp_fsdp(MLP(), mesh, sharder)
        opt = make(list(model.parameters()))
        calls = train(model, opt, STEPS)
        got, want = full(model), full(ref)
        rel = max(((got[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in want)
        res = {"bitwise": all(torch.equal(got[k], want[k]) for k in want), "rel": rel, "all_to_all": calls}
        if isinstance(opt, ro.BlockOptimizer):  # the runs each rank computes on are its own pieces of the param
            for n, p in model.named_parameters():
                out["layout_ok"] &= torch.equal(dtensor_layout(p).local_of_full(got[n]), p.to_local().reshape(-1))
        if isinstance(opt, ro.BlockOptimizer):
            res["computed"] = {n: opt.blocks_computed_here(p) for n, p in model.named_parameters() if _has_spec(opt, p)}
            res["all_blocks"] = {
                n: ref_opt.blocks_computed_here(q)
                for (n, p), q in zip(model.named_parameters(), ref.parameters())
                if _has_spec(opt, p)
            }
        out[name] = res
    for n, p in model.named_parameters():
        out.setdefault("placements", {})[n] = str(tuple(p.placements))
    return out


def _has_spec(opt, p) -> bool:
    g = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
    return opt.block_spec(p, g) is not None


@pytest.mark.parametrize("sharder", ["torch", "ours"])
@pytest.mark.parametrize("shape", [(2, 2), (1, 2), (2, 1, 2)])
def test_every_optimizer_on_fsdp2_tp_params_equals_one_process(shape, sharder):
    """With ``sharder="ours"``: ``ro.fully_shard`` over the dp dim of the TP model (params ``(RaggedShard(),
    Shard(0))``, ...): on 3a45141 every BlockOptimizer refused them (``NotImplementedError: ... would compute its
    blocks per TP rank``)."""
    results = run_on_ranks(run_layout, math.prod(shape), shape, sharder, timeout_s=300)
    r0 = results[0]
    if sharder == "torch":
        assert "_StridedShard" in r0["placements"]["up.weight"] and "Shard(dim=1)" in r0["placements"]["down.weight"]
    else:
        assert "RaggedShard" in r0["placements"]["up.weight"] and "Shard(dim=1)" in r0["placements"]["down.weight"]
    assert all(r["layout_ok"] for r in results)
    # the control: torch's own optimizer on torch's FSDP2 + TP params is exact (element-wise math, no reductions)
    assert r0["torch_adamw"]["bitwise"], r0["torch_adamw"]
    for name in OPTIMIZERS:
        res = r0[name]
        assert res["bitwise"], (name, shape, res["rel"])
        assert all(c <= 2 for r in results for c in r[name]["all_to_all"]), (
            name,
            [r[name]["all_to_all"] for r in results],
        )
        for n, blocks in res["all_blocks"].items():  # each block computed once in the whole job
            done = sorted(b for r in results for b in r[name]["computed"][n])
            assert done == blocks, (name, n, done, blocks)
    # ours equals one process bitwise; the peer on the same params, through DTensor's redistributions, does not
    # have to (it is reported for the record); it must at least have stepped near its own one-process run
    if sharder == "torch":
        assert r0["muon"]["rel"] <= r0["torch_muon"]["rel"]


def muon_owners(rank, world, shape):
    mesh = make_mesh(shape)
    model = nn.Module()
    torch.manual_seed(0)
    model.mats = nn.ModuleList([nn.Linear(9, 9 + i, bias=False) for i in range(4)])  # four matrices, four costs
    plan = {f"mats.{i}": ColwiseParallel() if i % 2 else RowwiseParallel() for i in range(4)}
    parallelize_module(model, mesh["tp"], plan)
    fully_shard(model, mesh=mesh["dp"])
    opt = ro.Muon(model.parameters(), lr=0.05)
    return [len(opt.blocks_computed_here(p)) for p in model.parameters()]


def test_muon_owners_spread_over_every_rank_of_the_mesh():
    """Four matrices, each cut over both mesh dims, on a (2, 2) mesh: the owners are balanced over all 4 ranks (not
    within one tp group, where a dp pair would each compute its tp half of the job)."""
    per_rank = run_on_ranks(muon_owners, 4, (2, 2))
    assert [sum(r[i] for r in per_rank) for i in range(4)] == [1, 1, 1, 1]
    assert all(sum(r) == 1 for r in per_rank), per_rank


def partial_params(rank, world):
    mesh = make_mesh((2, 2))
    w = nn.Parameter(DTensor.from_local(torch.ones(3, 4), mesh, [Shard(0), Partial()], run_check=False))
    msgs = {}
    for name, make in OPTIMIZERS.items():
        try:
            make([w])
        except ValueError as e:
            msgs[name] = str(e)
    return msgs


def test_partial_placements_are_refused_naming_the_param_and_the_fix():
    msgs = run_on_ranks(partial_params, 4)[0]
    assert set(msgs) == set(OPTIMIZERS), msgs
    for m in msgs.values():
        assert "Partial" in m and "param_groups[0]['params'][0]" in m and "redistribute" in m, m


# ----------------------------------------------------------------------------------------------- state dicts

SAVED_STEPS = 2


STATE_OPTIMIZERS = ["muon", "adamw8bit", "shampoo", "soap"]


def save_nd(rank, world, root, shape, sharder="torch"):
    mesh = make_mesh(shape)
    for name in STATE_OPTIMIZERS:
        model = tp_fsdp(MLP(), mesh, sharder)
        opt = OPTIMIZERS[name](list(model.parameters()))
        train(model, opt, SAVED_STEPS)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/{name}")
        ro.save_checkpoint(f"{root}/{name}_ro", model, opt)


def load_and_continue(rank, world, root, shape, sharder="torch"):
    """Load at ``shape`` (None: a plain model, one process) and take one more step: equal to a run that never
    stopped only when every state tensor came back exactly."""
    mesh = None if shape is None else make_mesh(shape)
    out = {}
    for name in STATE_OPTIMIZERS:
        for how in ("dcp", "ro"):
            model = MLP(seed=5)
            if mesh is not None:
                tp_fsdp(model, mesh, sharder)
            opt = OPTIMIZERS[name](list(model.parameters()))
            if how == "dcp":
                msd, osd = get_state_dict(model, opt)
                state = {"model": msd, "optim": osd}
                dcp.load(state, checkpoint_id=f"{root}/{name}")
                set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
                opt.load_state_dict(opt.state_dict())  # and the optimizer's own state dict goes back in as it came out
            else:
                ro.load_checkpoint(f"{root}/{name}_ro", model, opt)
            train(model, opt, 1, first=SAVED_STEPS)
            out[name, how] = full(model)  # (a collective)
    return out if rank == 0 else None


def uninterrupted(rank, world):
    out = {}
    for name in STATE_OPTIMIZERS:
        model = MLP()
        train(model, OPTIMIZERS[name](list(model.parameters())), SAVED_STEPS + 1)
        out[name] = full(model)
    return out


def test_state_saved_at_2x2_reloads_at_2x1_1x2_and_plain_exactly(tmp_path):
    """get_state_dict + dcp.save of every optimizer's state on FSDP2 + TP params at (2, 2), dcp.load +
    set_state_dict at (2, 1), (1, 2) and on a plain model, then one more step: bitwise the run that never stopped
    (Muon's momentum, 8-bit codes and scales per block, Shampoo's and SOAP's per-band factors). The same through
    ro.save_checkpoint / ro.load_checkpoint."""
    root = str(tmp_path)
    run_on_ranks(save_nd, 4, root, (2, 2), timeout_s=300)
    want = run_on_ranks(uninterrupted, 1)[0]
    for shape in [(2, 1), (1, 2), None]:
        world = 1 if shape is None else math.prod(shape)
        got = run_on_ranks(load_and_continue, world, root, shape, timeout_s=300)[0]
        for (name, how), params in got.items():
            for k in want[name]:
                diff = (params[k] - want[name][k]).abs().max().item()
                assert torch.equal(params[k], want[name][k]), (name, how, shape, k, diff)


def test_state_of_our_tp_params_moves_to_every_layout_exactly(tmp_path):
    """The same with ``ro.fully_shard`` + TP: saved at (2, 2), loaded into ours at (3, 1) and (1, 2), into torch's
    fully_shard + TP at (2, 2) and into a plain model; and torch's (2, 2) checkpoint into ours at (2, 2). Every
    state tensor must come back exactly (the next step is bitwise the run that never stopped). On 3a45141 our
    optimizers refused these params."""
    want = run_on_ranks(uninterrupted, 1)[0]
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "torch")
    run_on_ranks(save_nd, 4, ours, (2, 2), "ours", timeout_s=300)
    run_on_ranks(save_nd, 4, theirs, (2, 2), "torch", timeout_s=300)
    loads = [(ours, (3, 1), "ours"), (ours, (1, 2), "ours"), (ours, (2, 2), "torch"), (ours, None, "ours")]
    loads.append((theirs, (2, 2), "ours"))
    for root, shape, sharder in loads:
        world = 1 if shape is None else math.prod(shape)
        got = run_on_ranks(load_and_continue, world, root, shape, sharder, timeout_s=300)[0]
        for (name, how), params in got.items():
            for k in want[name]:
                diff = (params[k] - want[name][k]).abs().max().item()
                assert torch.equal(params[k], want[name][k]), (root, shape, sharder, name, how, k, diff)
