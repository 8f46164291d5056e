"""Expert parallel with ``ro.fully_shard`` (issue 36, item 3): an MoE layer whose experts are split over an ``ep``
dim (each ep rank holds E / ep of them), the routing all-to-all the user's own (as in torchtitan), the experts
sharded over the data-parallel ranks that hold the same experts, the dense part over every rank. Each test runs
torch's ``fully_shard`` with the same meshes as the control and a one-process run of the whole model (every
expert on one rank, each rank's batch as a micro-batch) as the reference.

This composition needed no change of ours: the test passes on 212c331 too (the per-unit process groups of HSDP
already let each unit take its own mesh). It pins the recipe docs/parallelism.md gives, and FSDP2's behaviour
beside it. The last test (ranks of one mesh holding different expert counts raise at fully_shard) is new."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import ragged_optim as ro
from ragged_optim.comm.launch import run_on_ranks

D, H, EXPERTS, TOKENS, STEPS = 6, 10, 4, 12, 3


class Experts(nn.Module):
    """The experts this rank holds (ids ``first .. first + len - 1``), applied to tokens routed to them."""

    def __init__(self, ids: list[int]):
        super().__init__()
        self.first = ids[0]
        self.up = nn.ModuleList(nn.Linear(D, H) for _ in ids)
        self.down = nn.ModuleList(nn.Linear(H, D) for _ in ids)

    def forward(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for k, (up, down) in enumerate(zip(self.up, self.down)):
            # (an expert with no tokens runs on zero rows: a zero grad, not None, which FSDP2 needs to keep its
            # reduce-scatters the same size on every rank)
            rows = (expert == self.first + k).nonzero().squeeze(1)
            out = out.index_add(0, rows, down(F.gelu(up(x[rows]))))
        return out


class MoE(nn.Module):
    """Top-1 routing; tokens travel to their expert's ep rank and back by all-to-all (``ep_group`` None: every
    expert is here)."""

    def __init__(self, ep_group=None):
        super().__init__()
        self.ep_group = ep_group
        ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        rank = dist.get_rank(ep_group) if ep_group is not None else 0
        per = EXPERTS // ep
        self.router = nn.Linear(D, EXPERTS, bias=False)
        self.experts = Experts(list(range(rank * per, (rank + 1) * per)))
        self.per = per
        self.norm = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.softmax(self.router(x), dim=-1)
        expert = gate.argmax(dim=-1)
        weight = gate.gather(1, expert[:, None])
        if self.ep_group is None:
            y = self.experts(x, expert)
        else:
            y = self._dispatched(x, expert)
        return self.norm(x + weight * y)

    def _dispatched(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_to_all_single

        ep = dist.get_world_size(self.ep_group)
        order = torch.argsort(expert // self.per, stable=True)
        send = torch.bincount(expert // self.per, minlength=ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.ep_group)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        ids = torch.empty(sum(recv_sizes), dtype=expert.dtype)
        dist.all_to_all_single(ids, expert[order], recv_sizes, send_sizes, group=self.ep_group)
        tokens = all_to_all_single(
            torch.empty(sum(recv_sizes), D), x[order], recv_sizes, send_sizes, group=self.ep_group
        )
        back = all_to_all_single(
            torch.empty(x.shape[0], D), self.experts(tokens, ids), send_sizes, recv_sizes, group=self.ep_group
        )
        return torch.empty_like(back).index_copy(0, order, back)


class Net(nn.Module):
    def __init__(self, ep_group=None):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = MoE(ep_group)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        return self.head(self.moe(torch.tanh(self.inp(x))))


def _full_model() -> Net:
    torch.manual_seed(0)
    return Net()


def _ep_model(ep_group) -> Net:
    """The full model's weights, each rank keeping only its experts."""
    full = _full_model()
    model = Net(ep_group)
    state = full.state_dict()
    first = model.moe.experts.first
    for k in range(model.moe.per):
        for part in ("up", "down"):
            for leaf in ("weight", "bias"):
                state[f"moe.experts.{part}.{k}.{leaf}"] = state[f"moe.experts.{part}.{first + k}.{leaf}"]
    model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()})
    return model


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(TOKENS, D, generator=torch.Generator().manual_seed(100 * step + rank))


def _optimizer(model, which: str):
    if which == "adamw":  # (per param: the experts' DTensors and the dense part's are on different meshes)
        return torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.1, foreach=False)
    return ro.Muon(model.parameters(), lr=2e-2, adamw_lr=2e-2, ns_matmul="native")


def _single(world: int, which: str):
    model = _full_model()
    opt = _optimizer(model, which)
    for step in range(STEPS):
        (sum(model(_batch(r, step)).square().mean() for r in range(world)) / world).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _expert_parallel(kind: str, which: str, mesh, rank: int, world: int):
    model = _ep_model(mesh["ep"].get_group())
    shard = ro.fully_shard if kind == "ours" else torch_fully_shard
    # the experts over the ranks that hold the same ones; each expert's grad already sums the tokens of its ep
    # group, so the FSDP average over dp is made one over every rank, as torchtitan sets it
    shard(model.moe.experts, mesh=mesh["dp"])
    model.moe.experts.set_gradient_divide_factor(float(world))
    model.moe.experts.set_force_sum_reduction_for_comms(True)  # (gloo has no PREMUL_SUM, which FSDP2 would use)
    shard(model)  # the dense part over every rank
    opt = _optimizer(model, which)
    for step in range(STEPS):
        model(_batch(rank, step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    full = {}
    first = model.moe.experts.first
    for n, p in model.named_parameters():
        value = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if n.startswith("moe.experts."):
            part, k, leaf = n.split(".")[2:]
            n = f"moe.experts.{part}.{first + int(k)}.{leaf}"
        full[n] = value
    return full


def _run(rank, world, which):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    out = {kind: _expert_parallel(kind, which, mesh, rank, world) for kind in ("ours", "torch")}
    if rank == 0:
        out["single"] = _single(world, which)
    return out


def _distance(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.parametrize("which", ["adamw", "muon"])
def test_experts_over_an_ep_dim_train_as_one_process(which):
    """Every expert matrix is updated on the ranks of its ep slot only, each by the ranks that hold it; gathered
    over all ranks, the experts and the dense part must be the one-process run's, as close as FSDP2's (AdamW) or
    FSDP2 with ro.Muon on its params (Muon: each expert matrix computed by one owner among its holders)."""
    results = run_on_ranks(_run, 4, which)
    single = results[0]["single"]
    for got in results:
        ulp = torch.finfo(torch.float32).eps * max(float(p.abs().max()) for p in single.values())
        for n in got["ours"]:
            ours_gap = float((got["ours"][n] - single[n]).abs().max())
            fsdp2_gap = float((got["torch"][n] - single[n]).abs().max())
            assert ours_gap <= 4 * fsdp2_gap + 8 * ulp, (n, ours_gap, fsdp2_gap)
    # the ep ranks together hold every expert: each rank reports its own, all four cover the model
    seen = {n for got in results for n in got["ours"] if n.startswith("moe.experts.")}
    assert seen == {n for n in single if n.startswith("moe.experts.")}


def _uneven_experts_on_one_mesh(rank, world):
    """Ranks of one ``fully_shard`` mesh holding different expert counts (rank r: r + 1 experts), as when the
    experts are sharded over the whole mesh instead of the ranks that hold the same ones."""
    experts = Experts(list(range(rank + 1)))
    before = [id(p) for p in experts.parameters()]
    try:
        ro.fully_shard(experts)
        error = None
    except ValueError as e:
        error = str(e)
    untouched = [id(p) for p in experts.parameters()] == before and not isinstance(experts, FSDPModule)
    return error, untouched and not any(isinstance(p, DTensor) for p in experts.parameters())


def test_expert_counts_that_differ_across_a_mesh_raise_at_fully_shard():
    """Before: fully_shard took it and the mismatch surfaced at a later forward (or never, for an expert only one
    rank runs). Now every rank raises at the fully_shard call, naming the module and the fix, with nothing sharded."""
    for error, untouched in run_on_ranks(_uneven_experts_on_one_mesh, 2, timeout_s=60):
        assert error is not None and "fully_shard(Experts)" in error, error
        assert "hold the same experts" in error and "on rank 1" in error, error
        assert untouched


def _uneven_experts_across_ep(rank, world):
    """5 experts over ep 2 (3 and 2), each sharded over its own holders: fully_shard takes it; ro.Muon's owner
    exchange spans every rank, so its first step refuses, naming the param that differs."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    model = Net()
    model.moe.experts = Experts(list(range(3)) if mesh["ep"].get_local_rank() == 0 else [3, 4])
    ro.fully_shard(model.moe.experts, mesh=mesh["dp"])
    ro.fully_shard(model)
    opt = _optimizer(model, "muon")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return None


def test_expert_counts_that_differ_across_ep_ranks_raise_at_the_first_step():
    for error in run_on_ranks(_uneven_experts_across_ep, 4, timeout_s=90):
        assert error is not None and "ranks disagree on the optimizer's params" in error, error
        assert "experts divisible by ep" in error, error
