"""An optimizer built before ``fully_shard`` holds the params fully_shard replaced: it raises at its first step,
naming the param and the fix (issue 35). Before, ``torch.optim.AdamW(model.parameters())`` then
``ro.fully_shard(model)`` stepped without a word and trained nothing (checked: this test failed there; only our
own optimizers raised). Torch's FSDP2 is the control: it has the same trap and does not catch it.

One launch of 2 forked gloo ranks runs every case (a launch costs seconds here)."""

from __future__ import annotations

import torch
from torch import nn

import ragged_optim as ro
from ragged_optim.comm.launch import run_on_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer) -> str | None:
    """One step; the error's text, or None."""
    model(torch.ones(2, 8)).sum().backward()
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return None


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [ro.full_tensor(p).clone() for p in model.parameters()]


class _PlainSGD(torch.optim.Optimizer):
    """Anyone's optimizer: a subclass of torch.optim.Optimizer that knows nothing of sharding."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def _cases(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from ragged_optim.sharding import replaced_params

    out = {}
    # torch's AdamW, and anyone's optimizer, built before ro.fully_shard: an error at the first step, nothing stepped
    for label, make in (("adamw", lambda ps: torch.optim.AdamW(ps, lr=0.1)), ("plain", _PlainSGD)):
        model = _model()
        opt = make(model.parameters())
        ro.fully_shard(model)
        before = _full(model)
        out[f"{label}_error"] = _train_step(model, opt)
        out[f"{label}_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, _full(model)))

    # the fix the message names: the optimizer built after fully_shard trains
    model = _model()
    ro.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = _full(model)
    calls = []
    real_check = replaced_params.check_optimizer
    replaced_params.check_optimizer = lambda o: (calls.append(1), real_check(o))[1]
    try:
        errors = [_train_step(model, opt) for _ in range(3)]
        out["after_errors"] = errors
        out["after_checks_in_3_steps"] = len(calls)  # cached by param-group sizes: one check, at the first step
        out["after_trained"] = not all(torch.equal(a, b) for a, b in zip(before, _full(model)))
        # a group added later holding a replaced param: the sizes change, so the next step checks and raises
        stale = _model()
        stale_params = list(stale.parameters())
        ro.fully_shard(stale)
        opt.add_param_group({"params": stale_params[:1]})
        out["added_error"] = _train_step(model, opt)
    finally:
        replaced_params.check_optimizer = real_check

    # the control: torch's FSDP2 with the optimizer built before its fully_shard steps silently and trains nothing
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    torch_fully_shard(model)
    before = [p.full_tensor().clone() for p in model.parameters()]
    out["fsdp2_error"] = _train_step(model, opt)
    out["fsdp2_unchanged"] = all(torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters()))
    return out


def test_optimizer_built_before_fully_shard_raises_at_its_first_step():
    res = run_on_ranks(_cases, 2)
    for r in res:  # every rank raises the same: no rank is left waiting in a collective
        for label, cls in (("adamw", "AdamW"), ("plain", "_PlainSGD")):
            e = r[f"{label}_error"]
            assert e is not None, f"{cls} built before fully_shard stepped without an error"
            assert e.startswith(f"{cls}: param_groups[0]['params'][0] ('0.weight' in Sequential) with shape (8, 8)")
            assert "replaced by fully_shard" in e and "; build the optimizer after fully_shard" in e
            assert r[f"{label}_unchanged"]
        assert r["after_errors"] == [None, None, None] and r["after_trained"]
        assert r["after_checks_in_3_steps"] == 1
        assert r["added_error"] is not None and "param_groups[1]['params'][0] ('0.weight'" in r["added_error"]
        # FSDP2 has the same trap and says nothing (docs/runtime.md): the steps change no weight
        assert r["fsdp2_error"] is None and r["fsdp2_unchanged"]
    assert res[0] == res[1]
