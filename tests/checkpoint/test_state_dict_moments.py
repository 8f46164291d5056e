"""An optimizer's state dict is right at every moment, not only after its first step (issue 38).

On main, the conversion of ragged params' optimizer state to full-shape tensors was a hook that an optimizer's
first ``step`` installed; right after ``ro.load_checkpoint`` (or ``load_state_dict``) at another world size,
``opt.state_dict()`` and torch's ``get_state_dict(..., full_state_dict=True)`` gave each rank's flat piece under
the param (``head.weight.exp_avg`` of shape (84,) for (10, 15)), with no error: a job that resumes and exports at
once (a conversion, an eval-only job, a save right after a resume) lost its optimizer state.

Each run here saves after two steps at one world size, loads at another and reads the state dicts before any
step: torch's full optimizer state dict and every rank's own ``state_dict()`` must be those taken before the
save, bit for bit, and so must they after a ``dcp.save`` of torch's sharded state dict made right after the load
and a reload of it into fresh optimizers. Every optimizer kind is in each run: Muon with its AdamW half, Shampoo,
SOAP, AdamW8bit, a user's ``BlockOptimizer`` and torch's AdamW, on ragged and on torch FSDP2 params.
"""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)

import ragged_optim as ro
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.testing import _set_grads, default_grad

FULL = StateDictOptions(full_state_dict=True)
# Import what the optimizers import lazily (torch._dynamo) once here, not in every forked rank.
make_warm = torch.optim.SGD([nn.Parameter(torch.zeros(1))])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.muon = nn.Sequential(nn.Linear(15, 26), nn.Linear(26, 15))
        self.shampoo = nn.Sequential(nn.Linear(9, 7), nn.Linear(7, 5))
        self.soap = nn.Sequential(nn.Linear(9, 7), nn.Linear(7, 5))
        self.adam8 = nn.Linear(80, 64)  # 5184 elements: 8-bit codes and scales
        self.mine = nn.Linear(12, 10)
        self.plain = nn.Linear(6, 4)


class MomentumSign(ro.BlockOptimizer):
    """A user's optimizer: a momentum buffer under its own key, sign of it per band of 4 rows."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, dict(lr=lr))

    def block_spec(self, p, group):
        return ro.BlockSpec.rows(4, ro.full_shape(p)) if len(ro.full_shape(p)) == 2 else None

    @torch.no_grad()
    def step(self, closure=None):  # torch's get_state_dict passes closure=None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                st = self.state[p]
                if "velocity" not in st:
                    st["velocity"] = torch.zeros_like(ro.local(p))
                st["velocity"].mul_(0.9).add_(ro.local(p.grad))
            update = lambda blocks: [b.value.sign() for b in blocks]
            mats = [p for p in params if self.block_spec(p, group) is not None]
            outs = self.map_blocks(update, mats, [self.state[p]["velocity"] for p in mats])
            for p, u in zip(mats, outs):
                ro.local(p).add_(u, alpha=-group["lr"])
            for p in params:
                if self.block_spec(p, group) is None:
                    ro.local(p).add_(self.state[p]["velocity"], alpha=-group["lr"])


def optimizers(model):
    m = model.muon
    muon = ro.Muon(
        [
            {"params": [m[0].weight, m[1].weight], "use_muon": True},
            {"params": [m[0].bias, m[1].bias], "use_muon": False},
        ],
        lr=0.02,
        adamw_lr=1e-3,
        ns_dtype=torch.float32,
    )
    return [
        muon,
        ro.Shampoo(model.shampoo.parameters(), lr=0.01, max_preconditioner_dim=4, precondition_frequency=1),
        ro.SOAP(model.soap.parameters(), lr=0.01, max_preconditioner_dim=4, precondition_frequency=1),
        ro.AdamW8bit(model.adam8.parameters(), lr=0.01, block_size=64),
        MomentumSign(model.mine.parameters()),
        torch.optim.AdamW(model.plain.parameters(), lr=0.01),
    ]


def build(kind):
    model = Net()
    if kind == "ours":
        shard = ro.fully_shard
    else:
        from torch.distributed.fsdp import fully_shard as shard
    for sub in (model.muon, model.shampoo, model.soap, model.adam8, model.mine, model.plain):
        shard(sub)
    shard(model)
    return model, optimizers(model)


def _bands(v) -> bool:
    return isinstance(v, dict) and all(isinstance(k, int) for k in v)


def views(model, opts) -> dict[str, torch.Tensor]:
    """Every optimizer's state as torch's full state dict shows it (under 'j/param/key'), and every band of Shampoo
    and SOAP from the rank that holds it in its own ``state_dict()`` (torch's full state dict keeps rank 0's).
    A collective: every rank calls it; every rank gets the same."""
    out = {}
    for j, opt in enumerate(opts):
        full = get_optimizer_state_dict(model, opt, options=FULL)
        for name, st in full["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    out[f"{j}/{name}/{k}"] = v.detach().clone()
        held = {}
        own = opt.state_dict()
        ids = [i for g in own["param_groups"] for i in g["params"]]
        for pos, pid in enumerate(ids):
            for k, v in own["state"].get(pid, {}).items():
                if _bands(v):
                    for b, band in v.items():
                        for f, t in band.items():
                            for ti, tt in enumerate(t if isinstance(t, list) else [t]):
                                if isinstance(tt, torch.Tensor):
                                    held[f"{j}/{pos}/{k}/{b}/{f}/{ti}"] = tt.detach().clone()
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, held)
        for part in gathered:
            out.update(part)
    return out


def dcp_save(model, opts, path):
    msd, osd = get_state_dict(model, opts)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def dcp_load(model, opts, path):
    msd, osd = get_state_dict(model, opts)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opts, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def trained(kind):
    model, opts = build(kind)
    for step in range(2):
        _set_grads(model, step, default_grad)
        for o in opts:
            o.step()
            o.zero_grad()
    return model, opts


def save(rank, world, path, kind, how):
    model, opts = trained(kind)
    want = views(model, opts)
    if how == "ro":
        ro.save_checkpoint(path, model, opts)
    else:
        dcp_save(model, opts, path)
    return want if rank == 0 else None


def load(rank, world, path, kind, how):
    model, opts = build(kind)
    if how == "ro":
        ro.load_checkpoint(path, model, opts)
    else:
        dcp_load(model, opts, path)
    loaded = views(model, opts)  # before any step
    again = os.path.join(os.path.dirname(path), f"again{world}")
    try:
        dcp_save(model, opts, again)  # (on main: a CheckpointException on every rank)
        model2, opts2 = build(kind)
        dcp_load(model2, opts2, again)
        reloaded = views(model2, opts2)
    except BaseException as e:  # (torch's CheckpointException is a BaseException)
        reloaded = f"{type(e).__name__}: {e}"[:300]
    return (loaded, reloaded) if rank == 0 else None


def assert_bitwise(got: dict, want: dict, what: str):
    assert sorted(got) == sorted(want), f"{what}: keys {sorted(set(got) ^ set(want))[:6]}"
    bad = [k for k in want if got[k].shape != want[k].shape or not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {len(bad)} of {len(want)} differ, e.g. " + ", ".join(
        f"{k} {tuple(got[k].shape)} for {tuple(want[k].shape)}" for k in bad[:4]
    )


@pytest.mark.parametrize(
    "kind,how,w_save,w_load",
    [("ours", "ro", 4, 2), ("ours", "ro", 3, 1), ("ours", "ro", 2, 3), ("ours", "dcp", 3, 2), ("fsdp2", "dcp", 3, 2)],
    ids=str,
)
def test_state_dicts_right_after_a_resharding_load(tmp_path, kind, how, w_save, w_load):
    """ro.load_checkpoint (our params) or dcp.load + set_state_dict (ours and FSDP2's) at another world size."""
    path = str(tmp_path / "ckpt")
    want = run_on_ranks(save, w_save, path, kind, how)[0]
    assert any("/bands/" in k or k.count("/") == 5 for k in want) and any(k.endswith("_scales") for k in want)
    assert any(k.endswith("/velocity") for k in want)
    loaded, reloaded = run_on_ranks(load, w_load, path, kind, how)[0]
    assert_bitwise(loaded, want, "right after the load")
    assert isinstance(reloaded, dict), reloaded
    assert_bitwise(reloaded, want, "after dcp.save of that and a reload")


def step_all(model, opts, step):
    _set_grads(model, step, default_grad)
    for o in opts:
        o.step()
        o.zero_grad()
    return {n: ro.full_tensor(p).detach().clone() for n, p in model.named_parameters()}


def in_memory(rank, world, kind):
    """Each optimizer's own state_dict() into a fresh one's load_state_dict (as a user's resume without DCP),
    read before any step; then one more step of both."""
    model, opts = build(kind)
    for step in range(2):
        step_all(model, opts, step)
    want = views(model, opts)
    saved = [copy.deepcopy(o.state_dict()) for o in opts]
    fresh_model, fresh = build(kind)
    fresh_model.load_state_dict(model.state_dict())
    empty = [len(o.state_dict()["state"]) for o in fresh]  # after construction: nothing yet
    for o, sd in zip(fresh, saved):
        o.load_state_dict(sd)
    got = views(fresh_model, fresh)
    after = step_all(model, opts, 2), step_all(fresh_model, fresh, 2)
    return (want, got, empty, after) if rank == 0 else None


@pytest.mark.parametrize("kind", ["ours", "fsdp2"])
def test_state_dict_right_after_load_state_dict(kind):
    want, got, empty, (a, b) = run_on_ranks(in_memory, 3, kind)[0]
    assert empty == [0] * len(empty)
    assert_bitwise(got, want, "right after load_state_dict")
    assert_bitwise(b, a, "the params one step later")
