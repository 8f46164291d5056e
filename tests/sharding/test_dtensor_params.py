"""Sharded params are DTensors of full shape (issue 33, part 1): what code written for FSDP2 does to its params works
the same on ours. Each check runs torch FSDP2 on the same model in the same ranks as the control. On main the
params were plain 1-D pieces: ``p.shape`` was the local piece's, ``isinstance(p, DTensor)`` False, torch's
``clip_grad_norm_`` clipped each rank by its own local norm and ``p.copy_(full)`` raised a size mismatch."""

import pytest
import torch
from noise_bounds import allowed
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import ragged_optim as ro
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.testing import default_grad, set_full_grad

SHARDERS = {"ours": ro.fully_shard, "fsdp2": torch_fully_shard}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(37, 12)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 12)) for _ in range(2)])
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, 37)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(self.norm(h))


def build(kind):
    model = Net()
    for b in model.blocks:
        SHARDERS[kind](b)
    SHARDERS[kind](model)
    return model


def full(model) -> dict:
    return {n: p.full_tensor().clone() for n, p in model.named_parameters()}


def set_grads(model, step):
    for n, p in model.named_parameters():
        set_full_grad(p, default_grad(step, n, p.shape))  # p.shape: the full shape, on both


OPTIMIZERS = {
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=True),
    "adamw_loop": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=False),
    "adam_loop": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=True),
}


def like_fsdp2(rank, world):
    out = {}
    for kind in SHARDERS:
        res = {}
        model = build(kind)
        ps = dict(model.named_parameters())
        res["meta"] = {
            n: (isinstance(p, DTensor), isinstance(p, nn.Parameter), tuple(p.shape), p.dim(), p.numel())
            for n, p in ps.items()
        }
        res["decay_group"] = sorted(n for n, p in ps.items() if p.dim() >= 2)  # nanoGPT's weight-decay rule
        res["init"] = full(model)
        # torch's optimizers on the params, the same full grads on both sides
        for name, make in OPTIMIZERS.items():
            m = build(kind)
            opt = make(m.parameters())
            for step in range(3):
                set_grads(m, step)
                opt.step()
                opt.zero_grad()
            res[name] = full(m)
        # torch's clip_grad_norm_: the global norm, the same scaling
        m = build(kind)
        set_grads(m, 0)
        norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        res["clip_norm"] = norm.full_tensor().item() if isinstance(norm, DTensor) else norm.item()
        res["clipped"] = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
        # a grad over its own (global) norm: a ragged DTensor with a partial-norm DTensor
        res["unit_grads"] = {n: (p.grad / p.grad.norm()).full_tensor() for n, p in m.named_parameters()}
        # in-place init with full-shape semantics
        m = build(kind)
        with torch.no_grad():
            w = m.head.weight
            values = torch.arange(w.numel(), dtype=w.dtype).view(w.shape)
            w.copy_(distribute_tensor(values, w.device_mesh, w.placements))  # FSDP2's way
            if kind == "ours":
                w.zero_()
                w.copy_(values)  # also from the full tensor itself, which FSDP2 refuses (mixed Tensor and DTensor)
            w.mul_(2)
            m.head.bias.fill_(0.5)
            nn.init.zeros_(m.norm.bias)
            nn.init.ones_(m.norm.weight)
            nn.init.constant_(m.blocks[0][0].bias, 3.0)
            nn.init.normal_(m.blocks[1][0].weight, std=0.02)  # each rank draws its own piece: statistics only
            nn.init.kaiming_uniform_(m.blocks[1][2].weight)
        res["inited"] = full(m)
        # whole-tensor reductions (a collective, as on FSDP2); on head.weight's integers every sum is exact
        one = lambda t: t.full_tensor().item()  # noqa: E731
        reductions = (lambda t: t.max(), lambda t: t.min(), lambda t: (t > 0.5).any(), lambda t: (t > -1).all())
        res["reduced"] = {  # (the op on the param, the op on its full value)
            n: ([one(r(p)) for r in reductions], [r(p.full_tensor()).item() for r in reductions])
            for n, p in m.named_parameters()
        }
        res["sum, mean"] = (one(m.head.weight.sum()), one(m.head.weight.mean()), str(m.head.weight.sum().dtype))
        # torch 2.13's trunc_normal_ loops until no draw is out of bounds (mask.any() of the whole param)
        nn.init.trunc_normal_(m.blocks[0][2].weight, std=0.5, a=-0.4, b=0.4)
        res["trunc"] = m.blocks[0][2].weight.full_tensor()
        # torchtitan's fused-QKV init: new_empty of another shape is a replicated DTensor on the param's mesh;
        # its cat, copied in, gives each rank its part
        w = m.blocks[1][0].weight  # (20, 12)
        q, kv = w.new_empty(12, 12), w.new_zeros(8, 12)
        res["new_meta"] = [(type(t).__name__, tuple(t.shape), tuple(t.placements)) for t in (q, kv)]
        with torch.no_grad():
            q.copy_(distribute_tensor(torch.arange(144.0).view(12, 12), w.device_mesh, [Replicate()]))
            w.copy_(torch.cat([q, kv + 1]))
        res["fused"] = w.full_tensor()
        # redistribute as FSDP2 code does
        p = m.head.weight
        res["replicate"] = p.redistribute(p.device_mesh, [Replicate()]).to_local()
        rows = p.redistribute(p.device_mesh, [Shard(0)])
        res["shard0"] = rows.full_tensor(), tuple(rows.to_local().shape)
        # a module's own state-dict hook sees full-shape DTensors (torchtitan's _split_qkv_on_save reads shape[1])
        seen = {}

        def hook(_mod, sd, prefix, *_, seen=seen):
            seen.update({k[len(prefix) :]: (isinstance(v, DTensor), tuple(v.shape)) for k, v in sd.items() if
                         k.startswith(prefix)})  # fmt: skip

        m.blocks[0][0].register_state_dict_post_hook(hook)
        m.state_dict()
        res["hook_saw"] = dict(seen)
        # a real backward and a torch AdamW step: grads are DTensors of full shape
        m = build(kind)
        opt = torch.optim.AdamW(m.parameters(), lr=0.01)
        torch.manual_seed(10 + rank)
        x = torch.randint(0, 37, (2, 5))
        m(x).square().mean().backward()
        res["grad_meta"] = {n: (isinstance(p.grad, DTensor), tuple(p.grad.shape)) for n, p in m.named_parameters()}
        opt.step()
        res["trained"] = full(m)
        out[kind] = res
    # a one-process reference for the clipping norm's rounding
    ref = Net()
    set_grads(ref, 0)
    out["single_norm"] = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item()
    # an op that needs the whole tensor is refused by name
    model = build("ours")
    try:
        model.head.weight @ torch.ones(12)
        out["refused"] = None
    except RuntimeError as e:
        out["refused"] = str(e)
    return out if rank == 0 else None


@pytest.mark.parametrize("world", [2, 3])
def test_params_behave_as_fsdp2_dtensors(world):
    got = run_on_ranks(like_fsdp2, world)[0]
    ours, theirs = got["ours"], got["fsdp2"]
    assert ours["meta"] == theirs["meta"] and all(v[0] and v[1] for v in ours["meta"].values())
    assert ours["decay_group"] == theirs["decay_group"] == ["blocks.0.0.weight", "blocks.0.2.weight",
                                                            "blocks.1.0.weight", "blocks.1.2.weight", "emb.weight",
                                                            "head.weight"]  # fmt: skip
    for k in ("init", *OPTIMIZERS):  # element-wise math on the same full grads: the same bits
        for n, want in theirs[k].items():
            assert torch.equal(ours[k][n], want), (k, n, (ours[k][n] - want).abs().max().item())
    gap = abs(theirs["clip_norm"] - got["single_norm"])
    assert abs(ours["clip_norm"] - theirs["clip_norm"]) <= allowed(gap, theirs["clip_norm"])
    for n, want in theirs["clipped"].items():
        assert torch.allclose(ours["clipped"][n], want, rtol=allowed(gap / theirs["clip_norm"], 1.0), atol=0), n
    for n, want in theirs["unit_grads"].items():
        assert torch.allclose(ours["unit_grads"][n], want, rtol=allowed(gap / theirs["clip_norm"], 1.0), atol=0), n
    for n, want in theirs["inited"].items():
        if n == "blocks.1.0.weight":
            assert 0.01 < ours["inited"][n].std().item() < 0.03
        elif n == "blocks.1.2.weight":
            assert ours["inited"][n].abs().max() <= (6 / 20) ** 0.5 + 1e-6 and ours["inited"][n].std() > 0
        else:
            assert torch.equal(ours["inited"][n], want), n
    for n, (on_param, on_full) in ours["reduced"].items():
        assert on_param == on_full, n
        if n not in ("blocks.1.0.weight", "blocks.1.2.weight"):  # (not drawn at random: the same values)
            assert ours["reduced"][n] == theirs["reduced"][n], n
    assert ours["sum, mean"] == theirs["sum, mean"]
    trunc = ours["trunc"]
    assert trunc.abs().max() <= 0.4 and trunc.std() > 0.1  # (drawn per rank: statistics only)
    assert ours["new_meta"] == theirs["new_meta"]
    assert torch.equal(ours["fused"], theirs["fused"])
    assert torch.equal(ours["replicate"], theirs["replicate"])
    assert torch.equal(ours["shard0"][0], theirs["shard0"][0]) and ours["shard0"][1] == theirs["shard0"][1]
    assert ours["hook_saw"] == theirs["hook_saw"] == {"weight": (True, (20, 12)), "bias": (True, (20,))}
    assert ours["grad_meta"] == theirs["grad_meta"] and all(v[0] for v in ours["grad_meta"].values())
    if world == 2:  # a sum of two is the same in any order
        for n, want in theirs["trained"].items():
            assert torch.equal(ours["trained"][n], want), n
    assert "aten.mv" in got["refused"] and "full_tensor()" in got["refused"]


def grad_scaler_overflow(rank, world):
    """torch.amp.GradScaler (not the sharded one) with an inf in one rank's piece of one grad: every rank must skip
    the step, as with FSDP2's DTensor grads (whose unscale all-reduces the overflow flag)."""
    out = {}
    for kind in SHARDERS:
        model = build(kind)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        scaler.scale(torch.ones(()))  # (the scale is made at the first scale() call)
        set_grads(model, 0)
        if rank == 0:
            model.head.weight.grad.to_local().view(-1)[0] = float("inf")  # rank 0 holds head.weight's first rows
        before = full(model)
        scaler.step(opt)
        scaler.update()
        out[kind] = (all(torch.equal(before[n], v) for n, v in full(model).items()), scaler.get_scale())
    return out


def test_grad_scaler_skips_an_overflow_in_one_piece_on_every_rank():
    for rank_out in run_on_ranks(grad_scaler_overflow, 2):
        assert rank_out["fsdp2"] == (True, 2.0)  # the control: skipped, scale halved, on every rank
        assert rank_out["ours"] == rank_out["fsdp2"]
