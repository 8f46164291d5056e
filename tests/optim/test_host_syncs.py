"""No host syncs in a training step: the runtime's forward and backward read no tensor data on the host, and each
optimizer's step reads exactly one value (the non-finite flag, decided on the device) or none with the check off.

``ragged_optim.testing.host_reads`` records every host read of tensor data (``.item()``, ``bool(t)``,
``.tolist()``, ``nonzero``, ...): on a GPU each would be a device-to-host sync (what
``torch.cuda.set_sync_debug_mode("error")`` catches), found here on CPU. Step counters are CPU tensors by design
(as in torch.optim) and allowed. torch FSDP2 + torch.optim.AdamW on the same model runs as the control (it reads
nothing either; its reads are shown when ours fail)."""

import pytest
import torch
from fsdp_models import batch, loss_fn, make_model, shard
from torch.distributed.fsdp import MixedPrecisionPolicy

import ragged_optim as ro
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.optim.nonfinite import set_nonfinite_policy
from ragged_optim.testing import host_reads

OPTIMIZERS = {
    "muon": lambda m: ro.Muon(ro.muon_param_groups(m)),
    "adamw8bit": lambda m: ro.AdamW8bit(m.parameters(), block_size=64),
    # no root recompute in the checked steps (see docs/shampoo.md: recompute steps read each root's finiteness)
    "shampoo": lambda m: ro.Shampoo(m.parameters(), precondition_frequency=4, start_preconditioning_step=4),
    "soap": lambda m: ro.SOAP(m.parameters(), precondition_frequency=4),
}


def _fsdp2_control():
    """torch FSDP2 + torch.optim.AdamW (foreach) on the same model: what the same step reads there."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    model = make_model()
    shard(model, torch_fully_shard, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reads = []
    for step in range(2):
        with host_reads(allow=[s["step"] for s in opt.state.values()]) as r:
            loss_fn(model, *batch(step)).backward()
            opt.step()
        opt.zero_grad()
        reads.append([str(x) for x in r])
    return reads[-1]


def _steps(rank, world_size, names):
    out = {"fsdp2": _fsdp2_control()}
    for name in names:
        model = make_model()
        shard(model, ro.fully_shard, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        opt = OPTIMIZERS[name](model)
        reads = []
        for step, policy in enumerate(("skip", "skip", "off")):  # step 0 warms up (first-step checks, state)
            set_nonfinite_policy(opt, policy)
            counters = [s["step"] for s in opt.state.values() if "step" in s]
            with host_reads(allow=counters) as fwd_bwd:
                loss_fn(model, *batch(step)).backward()
            with host_reads(allow=counters) as opt_step:
                opt.step()
            opt.zero_grad()
            reads.append(([str(r) for r in fwd_bwd], [str(r) for r in opt_step]))
        out[name] = reads
    return out


def test_training_steps_read_nothing_on_the_host_but_the_nonfinite_flag():
    """Failed before: AdamW8bit's step read 28 values (each hyperparameter rounded to float32 through a tensor)."""
    names = tuple(OPTIMIZERS)
    for rank_out in run_on_ranks(_steps, 2, names):
        fsdp2 = rank_out["fsdp2"]  # the control: FSDP2's forward + backward + AdamW step after warm-up
        for name in names:
            (_, _), (fb_skip, step_skip), (fb_off, step_off) = rank_out[name]
            assert fb_skip == [] and fb_off == [], (name, fb_skip, fb_off, "FSDP2:", fsdp2)
            assert len(step_skip) == 1 and "nonfinite.py" in step_skip[0], (name, step_skip)
            assert step_off == [], (name, step_off)


def test_host_reads_sees_item_bool_tolist_nonzero_and_honours_allow():
    t, counter = torch.arange(4.0), torch.tensor(3.0)
    with host_reads(allow=[counter]) as reads:
        t.sum().item()
        bool(t[1] > 0)
        t.tolist()
        torch.nonzero(t)
        counter.item()
        t.mul(2).add_(1)  # no read
    ops = [r.op for r in reads]
    assert len(ops) == 4 and "tolist" in ops and "nonzero" in ops, ops
    assert all("test_host_syncs.py" in r.site for r in reads)


@pytest.mark.parametrize("make", [lambda p, lr: ro.Muon([p], lr=lr), lambda p, lr: ro.AdamW8bit([p], lr=lr),
                                  lambda p, lr: ro.Shampoo([p], lr=lr), lambda p, lr: ro.SOAP([p], lr=lr)])  # fmt: skip
def test_lr_tensor_off_the_host_is_refused_naming_lr(make):
    p = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=r"lr is a tensor on meta.*device sync.*CPU tensor"):
        make(p, torch.tensor(0.01, device="meta"))
    make(p, torch.tensor(0.01))  # a CPU tensor lr is fine
