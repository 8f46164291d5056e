"""Faults fail fast and bad input gets a clear answer: a rank that dies or stalls mid-step, NaN/Inf gradients on
sharded params (skipped on every rank together, or raised), integer/complex/empty params, an optimizer built
before fully_shard, ranks that disagree on the param set. docs/faults.md tabulates them."""

import copy
import os
import re
import time
import warnings

import pytest
import torch
from fsdp_models import TwoLinear as Net
from fsdp_models import shard_two_linear
from torch import nn

from ragged_optim.comm.launch import RankFailure, run_on_ranks
from ragged_optim.optim import AdamW8bit, Muon, Shampoo
from ragged_optim.optim.nonfinite import REPLACED_ATTR, set_nonfinite_policy
from ragged_optim.sharding import full_tensor, fully_shard, shard_info
from ragged_optim.testing import _set_grads, default_grad

# Import what the optimizers import lazily (torch._dynamo: ~10 s) once here, not in every forked rank.
_warm = torch.optim.SGD([nn.Parameter(torch.zeros(1))])


def sharded_net(**kw):
    return shard_two_linear(fully_shard, **kw)


def muon_for(model, cls=Muon):
    return cls(
        [
            {"params": [model.a.weight, model.b.weight], "use_muon": True},
            {"params": [model.a.bias, model.b.bias], "use_muon": False},
        ],
        lr=0.02,
        ns_dtype=torch.float32,
    )


# ----------------------------------------------------------------------------------------------- lost ranks


def die_mid_step(rank, world, mode):
    model = sharded_net()
    opt = muon_for(model)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for step in range(3):
        loss = model(x).sum()
        if step == 1 and rank == 1:  # after the forward's all-gathers, before the backward's reduce-scatter
            if mode == "die":
                os._exit(7)
            time.sleep(120)  # stalls: alive, never joins the next collective
        loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("mode,timeout_s", [("die", 10.0), ("stall", 4.0)])
def test_lost_rank_fails_fast(mode, timeout_s):
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as exc:
        run_on_ranks(die_mid_step, 3, mode, timeout_s=timeout_s)
    elapsed = time.monotonic() - t0
    msg = str(exc.value)
    # The peers' collective errors out (connection closed by the dead peer, or gloo's timeout for a stalled one)
    # instead of hanging; the report names the ranks that failed and why.
    assert elapsed < timeout_s + 10.0, f"took {elapsed:.1f} s"
    assert re.search(r"rank [0-2] (failed|died)", msg), msg[:2000]
    assert re.search(r"closed by peer|reset by peer|[Tt]imed out|died|timeout", msg), msg[:2000]
    if mode == "die":
        assert elapsed < 10.0  # a dead peer closes its connections: no need to wait for the timeout


def test_dead_rank_is_named():
    with pytest.raises(RankFailure) as exc:
        run_on_ranks(die_mid_step, 3, "die", timeout_s=10.0)
    assert "rank 1 died" in str(exc.value).split("\n", 1)[0]


# ----------------------------------------------------------------------------------------------- NaN / Inf


def _local_state(opt):
    return copy.deepcopy({id(p): s for p, s in opt.state.items()})


def _same_state(a, b) -> bool:
    def eq(x, y):
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, list | tuple):
            return len(x) == len(y) and all(eq(u, v) for u, v in zip(x, y))
        return x == y

    return eq(a, b)


class Three(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.m = nn.Linear(10, 12)
        self.s = nn.Linear(9, 7)
        self.q = nn.Linear(16, 12)


def three_opts(model):
    return [
        Muon(
            [{"params": [model.m.weight], "use_muon": True}, {"params": [model.m.bias], "use_muon": False}],
            ns_dtype=torch.float32,
        ),
        Shampoo(model.s.parameters(), max_preconditioner_dim=3, epsilon=1e-6),
        AdamW8bit(model.q.parameters(), block_size=32, min_8bit_size=64),
    ]


def nonfinite_run(rank, world, policy, bad_value):
    model = Three()
    for sub in (model.m, model.s, model.q):
        fully_shard(sub)
    fully_shard(model)
    opts = three_opts(model)
    for o in opts:
        set_nonfinite_policy(o, policy)
    _set_grads(model, 0, default_grad)
    for o in opts:
        o.step()
    out = {}
    for name, victim in (("m", model.m.weight), ("s", model.s.weight), ("q", model.q.weight)):
        _set_grads(model, 1, default_grad)
        info = shard_info(victim)
        holder = next(r for r in range(world) if info.unit.layout.local_range(r, info.index)[0] == 0)
        if rank == holder:  # only the rank that holds element 0 of this param sees the bad value
            victim.grad.to_local()[0] = bad_value
        before = victim.detach().clone()
        states = [_local_state(o) for o in opts]
        errors = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for o in opts:
                try:
                    o.step()
                except FloatingPointError as e:
                    errors.append(str(e))
        out[name] = dict(
            victim_unchanged=torch.equal(before, victim),
            state_kept=[_same_state(s, _local_state(o)) for s, o in zip(states, opts)],
            counts=[getattr(o, "found_nonfinite", 0) for o in opts],
            warnings=[str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
            errors=errors,
        )
    # a finite step afterwards still trains
    _set_grads(model, 2, default_grad)
    before = [p.detach().clone() for p in model.parameters()]
    for o in opts:
        o.step()
    out["moved"] = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()) if a.numel())
    return out


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_nonfinite_grad_skips_on_every_rank(bad_value):
    results = run_on_ranks(nonfinite_run, 3, "skip", bad_value)
    for rank, res in enumerate(results):
        for k, name in enumerate(("m", "s", "q")):
            r = res[name]
            # the optimizer owning the bad param skipped on every rank; the others stepped as usual
            assert r["victim_unchanged"] and r["state_kept"][k], (rank, name)
            assert r["counts"][k] == 1, (rank, name, r["counts"])  # the same decision on every rank
            assert sum(r["counts"]) == k + 1  # counts add up over the loop: the others stepped
            assert any("NaN or Inf gradient in" in w and "with shape" in w for w in r["warnings"]), r["warnings"]
            assert not r["errors"]
        assert res["moved"]


def test_nonfinite_grad_raises_when_asked():
    results = run_on_ranks(nonfinite_run, 2, "raise", float("nan"))
    for res in results:
        for k, name in enumerate(("m", "s", "q")):
            r = res[name]
            assert len(r["errors"]) == 1 and "non-finite" in r["errors"][0], r["errors"]
            assert "with shape" in r["errors"][0]
            assert r["victim_unchanged"] and r["state_kept"][k]


def test_nonfinite_plain_tensors_no_collective():
    p = nn.Parameter(torch.ones(4, 4))
    opt = Muon([p], ns_dtype=torch.float32)
    p.grad = torch.full((4, 4), float("nan"))
    with pytest.warns(RuntimeWarning, match=r"skipped.*param_groups\[0\]\['params'\]\[0\] with shape \(4, 4\)"):
        opt.step()
    assert torch.equal(p, torch.ones(4, 4)) and not opt.state
    with pytest.raises(ValueError, match="nonfinite policy must be one of"):
        set_nonfinite_policy(opt, "ignore")


@pytest.mark.parametrize(
    "dtype, big", [(torch.float32, 1e20), (torch.bfloat16, 1e20), (torch.float16, 6e4)], ids=["fp32", "bf16", "fp16"]
)
def test_huge_finite_grads_are_not_skipped(dtype, big):
    """The screen is the grads' 2-norm, whose squares overflow for finite grads above ~1.8e19 (fp16: its largest
    magnitude, whose squares would overflow at 256); the exact pass that names bad params clears such a flag: the
    step runs, with no warning. An Inf next to them is still caught."""
    p = nn.Parameter(torch.ones(8, 8, dtype=dtype))
    opt = AdamW8bit([p], lr=0.1, min_8bit_size=1 << 20)  # fp32 state; lr big enough to move a bf16 1.0
    p.grad = torch.full((8, 8), big, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    assert not torch.equal(p, torch.ones(8, 8, dtype=dtype)) and opt.__dict__.get("found_nonfinite", 0) == 0
    before = p.detach().clone()
    p.grad[0, 0] = float("inf")
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step()
    assert torch.equal(p, before)


# ----------------------------------------------------------------------------------------------- bad input


def test_integer_param_is_refused():
    ints = nn.Parameter(torch.zeros(3, 3, dtype=torch.int64), requires_grad=False)
    opt = Muon([ints])
    with pytest.raises(
        TypeError, match=r"param_groups\[0\]\['params'\]\[0\] with shape \(3, 3\) has dtype torch.int64"
    ):
        opt.step()
    with pytest.raises(TypeError, match="only floating-point params can be sharded"):
        m = nn.Linear(2, 2)
        m.weight = nn.Parameter(torch.zeros(2, 2, dtype=torch.int32), requires_grad=False)
        fully_shard(m, mesh=object())


def test_complex_param_is_refused():
    c = nn.Parameter(torch.zeros(3, 3, dtype=torch.complex64))
    for cls in (Muon, Shampoo, AdamW8bit):
        with pytest.raises(ValueError, match=r"complex.*view_as_real"):
            cls([c])


def test_empty_param_is_refused_by_muon_and_shampoo():
    e = nn.Parameter(torch.zeros(0, 5))
    with pytest.raises(ValueError, match=r"with shape \(0, 5\) has no elements.*Leave it out"):
        Muon([{"params": [e], "use_muon": True}])  # (split by shape, it takes the AdamW path, as torch.optim.Muon)
    with pytest.raises(ValueError, match=r"with shape \(0, 5\) has no elements.*Leave it out"):
        Shampoo([e])


def built_before_shard(rank, world):
    out = {}
    # mixed: a is sharded before the optimizer is built, b after (b's old params are stale)
    model = Net()
    fully_shard(model.a)
    opt = muon_for(model, Muon)
    fully_shard(model.b)
    fully_shard(model)
    loss = model(torch.ones(2, 8)).sum()
    loss.backward()
    try:
        opt.step()
    except RuntimeError as e:
        out["mixed"] = str(e)
    # all stale: the optimizer was built on the unsharded model
    model = Net()
    old = model.a.weight
    opt = muon_for(model, Muon)
    fully_shard(model)
    model(torch.ones(2, 8)).sum().backward()
    out["marked"] = getattr(old, REPLACED_ATTR, None) is not None
    try:
        opt.step()
    except RuntimeError as e:
        out["all"] = str(e)
    return out


def test_optimizer_built_before_fully_shard():
    res = run_on_ranks(built_before_shard, 2)[0]
    assert "b.weight" in res["mixed"] or "with shape (4, 8)" in res["mixed"]
    assert "build the optimizer after fully_shard" in res["mixed"]
    assert res["marked"]
    assert "'a.weight'" in res["all"] and "replaced by fully_shard" in res["all"]


def disagreeing_ranks(rank, world):
    model = sharded_net()
    biases = [model.a.bias, model.b.bias] if rank == 0 else [model.a.bias]
    opt = Muon([{"params": [model.a.weight, model.b.weight], "use_muon": True}, {"params": biases, "use_muon": False}])
    _set_grads(model, 0, default_grad)
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return None


def test_ranks_disagree_on_param_set():
    t0 = time.monotonic()
    msgs = run_on_ranks(disagreeing_ranks, 2, timeout_s=30)
    assert time.monotonic() - t0 < 30
    for m in msgs:
        assert m is not None and "ranks disagree on the optimizer's params" in m
        assert "rank 0 has 4 params, rank 1 has 3" in m


def disagreeing_constructions(rank, world):
    """Ranks that build an optimizer differently fail at construction, before any layout moves."""
    out = {}
    builds = {
        "muon_params": lambda m: Muon([{"params": [m.a.weight, m.b.weight][: 2 - rank], "use_muon": True}]),
        "adamw8bit_block": lambda m: AdamW8bit(m.parameters(), block_size=64 * (1 + rank), min_8bit_size=16),
    }
    for key, build in builds.items():
        torch.manual_seed(0)
        model = sharded_net() if key == "muon_params" else fully_shard(nn.Linear(64, 64))
        before = {n: full_tensor(p).clone() for n, p in model.named_parameters()}
        try:
            build(model)
            out[key] = None
        except ValueError as e:
            out[key] = str(e)
        after = {n: full_tensor(p) for n, p in model.named_parameters()}
        out[key + "_unchanged"] = all(torch.equal(before[n], after[n]) for n in before)
    return out


def test_ranks_disagree_at_construction():
    t0 = time.monotonic()
    results = run_on_ranks(disagreeing_constructions, 2, timeout_s=60)
    assert time.monotonic() - t0 < 60
    for res in results:
        for key in ("muon_params", "adamw8bit_block"):
            assert res[key] is not None and "ranks build this optimizer over different sharded params" in res[key]
            assert res[key + "_unchanged"], key
