"""Our optimizers behave as any torch.optim.Optimizer does where training code relies on it (one process, CPU):
``copy.deepcopy``/``pickle`` keep the settings, ``load_state_dict`` runs again into the same optimizer and runs the
load hooks before its checks, a refused ``add_param_group`` changes nothing, empty params are taken where torch
takes them, and a scheduler that cycles momentum cycles the AdamW half's beta1 as it does torch.optim.AdamW's."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from ragged_optim import set_nonfinite_policy
from ragged_optim.optim import SOAP, AdamW8bit, Muon, Shampoo, muon_param_groups

CLASSES = [Muon, Shampoo, SOAP, AdamW8bit]
SHAPE = (80, 64)  # 8-bit state for AdamW8bit (>= min_8bit_size)


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g).requires_grad_(), torch.randn(64, generator=g).requires_grad_()]


def _grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _stepped(cls, steps: int = 2, **kw):
    params = _params()
    opt = cls(params, **kw)
    for s in range(steps):
        _grads(params, s)
        opt.step()
    return opt, params


def _continue(opt, params, steps=(5, 6)) -> list[torch.Tensor]:
    for s in steps:
        _grads(params, s)
        opt.step()
    return [p.detach().clone() for p in params]


def _copy_of(opt, how: str):
    """A copy of ``opt`` and of its params: deepcopy both together, or pickle both together."""
    params = [p for g in opt.param_groups for p in g["params"]]
    if how == "deepcopy":
        return copy.deepcopy((opt, params))
    return pickle.loads(pickle.dumps((opt, params)))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("cls", CLASSES)
def test_a_copy_keeps_the_settings_and_steps_as_the_original(cls, how):
    kw = dict(foreach=False, ns_matmul="native", wire_dtype=torch.float32) if cls is Muon else {}
    opt, params = _stepped(cls, **kw)
    set_nonfinite_policy(opt, "raise")
    twin, twin_params = _copy_of(opt, how)
    assert twin.nonfinite == "raise"
    if cls is Muon:
        assert (twin.foreach, twin.ns_matmul, twin.wire_dtype) == (False, "native", torch.float32)
    after = _continue(opt, params)
    after_twin = _continue(twin, twin_params)
    assert all(torch.equal(a, b) for a, b in zip(after, after_twin))
    twin_params[0].grad = torch.full(SHAPE, float("nan"))
    with pytest.raises(FloatingPointError, match="non-finite"):  # the policy of the original, not the default
        twin.step()


@pytest.mark.parametrize("cls", CLASSES)
def test_load_state_dict_twice_and_into_a_copy(cls):
    src, src_params = _stepped(cls)
    saved = copy.deepcopy(src.state_dict())
    opt, params = _stepped(cls, steps=1)
    opt.load_state_dict(copy.deepcopy(saved))
    opt.load_state_dict(copy.deepcopy(saved))  # torch's __setstate__ of the first load adds "differentiable"
    twin, twin_params = _copy_of(opt, "pickle")
    twin.load_state_dict(copy.deepcopy(saved))
    with torch.no_grad():
        for p, q, r in zip(params, twin_params, src_params):
            p.copy_(r)
            q.copy_(r)
    want = _continue(src, src_params)
    for o, ps in ((opt, params), (twin, twin_params)):
        assert all(torch.equal(a, b) for a, b in zip(_continue(o, ps), want))


@pytest.mark.parametrize("cls", CLASSES)
def test_load_pre_hook_runs_before_the_checks_and_post_hook_after_the_load(cls):
    src, _ = _stepped(cls)
    saved = copy.deepcopy(src.state_dict())
    lr = saved["param_groups"][0].pop("lr")  # an old checkpoint, without a key this version needs
    opt, _ = _stepped(cls, steps=1)
    seen = {}

    def fix_up(o, sd):
        seen["state_keys"] = sorted(next(iter(sd["state"].values())))
        sd["param_groups"][0]["lr"] = lr
        return sd

    def after(o):
        p = o.param_groups[0]["params"][0]
        seen["loaded"] = sorted(o.state[p])

    opt.register_load_state_dict_pre_hook(fix_up)
    opt.register_load_state_dict_post_hook(after)
    opt.load_state_dict(saved)
    want = sorted(next(iter(src.state_dict()["state"].values())))
    assert seen["state_keys"] == want  # the hook sees the state as saved (AdamW8bit: with its 8-bit entries)
    assert seen["loaded"] == want  # the post-hook runs once all of it is loaded
    assert opt.param_groups[0]["lr"] == lr


def test_muon_takes_empty_params_where_torch_does():
    model = nn.Sequential(nn.Linear(8, 0), nn.Linear(0, 8), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    for opt in (Muon(muon_param_groups(model)), Muon(model.parameters())):
        model(x).sum().backward()
        opt.step()
    empty = torch.zeros(0, requires_grad=True)
    Muon([{"params": [torch.zeros(3, 3, requires_grad=True)]}, {"params": [empty], "use_muon": False}]).step()
    with pytest.raises(ValueError, match=r"has no elements; Muon cannot orthogonalize.*use_muon=False"):
        Muon([{"params": [torch.zeros(0, 4, requires_grad=True)], "use_muon": True}])


def test_a_refused_split_group_leaves_muon_unchanged():
    w, b = torch.zeros(4, 4, requires_grad=True), torch.zeros(4, requires_grad=True)
    opt = Muon([w, b])
    before = [(g["use_muon"], len(g["params"])) for g in opt.param_groups]
    w2 = torch.zeros(4, 4, requires_grad=True)
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        opt.add_param_group({"params": [w2, b]})  # the matrix half is fine, the 1-D half repeats b
    assert [(g["use_muon"], len(g["params"])) for g in opt.param_groups] == before


def test_one_cycle_lr_cycles_muons_momentum_and_the_adamw_beta1_as_torch():
    """ro.Muon with one OneCycleLR == torch.optim.Muon + torch.optim.AdamW with one OneCycleLR each, bit for bit
    (the scheduler writes group["momentum"]; torch's AdamW gets it as betas[0])."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    twin = copy.deepcopy(model)
    kw = dict(total_steps=8, pct_start=0.5)
    ours = Muon(muon_param_groups(model), lr=0.02, adamw_lr=3e-3, ns_matmul="native")
    groups = muon_param_groups(twin)
    mats = next(g["params"] for g in groups if g["use_muon"])
    rest = next(g["params"] for g in groups if not g["use_muon"])
    t_muon = torch.optim.Muon(mats, lr=0.02, momentum=0.95, weight_decay=0.0, adjust_lr_fn="original")
    t_adamw = torch.optim.AdamW(rest, lr=3e-3, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)
    scheds = [
        torch.optim.lr_scheduler.OneCycleLR(ours, max_lr=[0.02, 3e-3], **kw),
        torch.optim.lr_scheduler.OneCycleLR(t_muon, max_lr=0.02, **kw),
        torch.optim.lr_scheduler.OneCycleLR(t_adamw, max_lr=3e-3, **kw),
    ]
    betas = []
    for step in range(kw["total_steps"]):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        for m in (model, twin):
            m(x).square().mean().backward()
        for o in (ours, t_muon, t_adamw):
            o.step()
            o.zero_grad()
        betas.append(ours.param_groups[1]["betas"][0])  # the beta1 this step used
        assert ours.param_groups[1]["betas"] == t_adamw.param_groups[0]["betas"]
        for s in scheds:
            s.step()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q), step
    assert len(set(betas)) > 3  # it did cycle


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_adamw_paths_on_low_precision_params_equal_torchs_single_tensor_adamw(dtype):
    """Muon's AdamW half and AdamW8bit's small params (both foreach by default) == torch.optim.AdamW(foreach=False),
    params and state bit for bit. Before: on a CPU torch's foreach ops rounded eps, beta2 and the decay factor to
    bf16/fp16 first (7-16 of 64 elements of exp_avg_sq off per step)."""
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def run(make):
        p = nn.Parameter(torch.randn(64, generator=torch.Generator().manual_seed(0)).to(dtype))
        opt = make(p)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
            opt.step()
        return p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]

    want = run(lambda p: torch.optim.AdamW([p], foreach=False, **kw))
    adamw = {f"adamw_{k}": v for k, v in kw.items()}
    for make in (
        lambda p: AdamW8bit([p], min_8bit_size=10**9, **kw),
        lambda p: Muon([{"params": [p], "use_muon": False}], **adamw),
        lambda p: Muon([{"params": [p], "use_muon": False}], foreach=True, **adamw),
    ):
        assert all(torch.equal(a, b) for a, b in zip(run(make), want))


def test_muon_foreach_weight_decay_on_bf16_matrices_equals_per_param():
    def run(foreach):
        p = nn.Parameter(torch.randn(8, 6, generator=torch.Generator().manual_seed(0)).bfloat16())
        opt = Muon([p], weight_decay=0.1, foreach=foreach)
        p.grad = torch.randn(8, 6, generator=torch.Generator().manual_seed(1)).bfloat16()
        opt.step()
        return p.detach()

    assert torch.equal(run(True), run(False))


@pytest.mark.parametrize("cls", CLASSES)
def test_compiled_step_runs_and_equals_the_eager_step(cls):
    """``torch.compile(opt.step)`` (torch's compiled-optimizer recipe). Before: AdamW8bit, Shampoo and SOAP raised
    InternalTorchDynamoError from inside their step; now dynamo leaves their step eager."""
    runs = []
    for compiled in (False, True):
        opt, params = _stepped(cls, steps=0)
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        for s in range(2):
            _grads(params, s)
            step()
        runs.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


# ----------------------------------------------------------------------------------------------- sharded groups


class _TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 6, bias=False)
        self.b = nn.Linear(11, 13, bias=False)

    def forward(self, x):
        return self.b(torch.cat([self.a(x), x[:, :5]], dim=-1))


def _two_linears():
    torch.manual_seed(0)
    return _TwoLinears()


def _shard_two(m):
    from ragged_optim import fully_shard

    fully_shard(m.b)
    fully_shard(m)


GROWN = {
    Muon: lambda m: Muon([m.a.weight], lr=0.02),
    Shampoo: lambda m: Shampoo([m.a.weight], lr=1e-2, max_preconditioner_dim=4),
    SOAP: lambda m: SOAP([m.a.weight], lr=1e-2, max_preconditioner_dim=4),
    AdamW8bit: lambda m: AdamW8bit([m.a.weight], lr=1e-2, block_size=4, min_8bit_size=1),
}


@pytest.mark.parametrize("cls", CLASSES)
def test_add_param_group_on_sharded_params_equals_one_process(cls):
    """A group added to a built optimizer over ro.fully_shard params. Before: its blocks were never declared, so the
    unit kept a layout that cut them and they were computed in pieces (Shampoo 0.039, SOAP 0.035, Muon 0.020 off
    the one-process params at step 0); AdamW8bit refused it, blaming another optimizer."""
    from ragged_optim.testing import assert_sharded_matches_single

    def make(m):
        opt = GROWN[cls](m)
        opt.add_param_group({"params": [m.b.weight], **({"block_size": 16} if cls is AdamW8bit else {})})
        return opt

    assert_sharded_matches_single(_two_linears, make, world_size=2, shard_fn=_shard_two)


def _built_after_backward(rank, world_size, sharded, micro_batches=1):
    from ragged_optim import full_tensor

    m = _two_linears()
    if sharded:
        _shard_two(m)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    parts = x.chunk(world_size)[rank : rank + 1] if sharded else x.chunk(micro_batches)
    for rows in parts:
        (m(rows).square().sum() / (world_size if sharded else 1)).backward()
    opt = Muon([m.a.weight, m.b.weight], lr=0.02)  # re-plans the units: the grads must move with their elements
    opt.step()
    return [full_tensor(p).detach().clone() for p in (m.a.weight, m.b.weight)]


def test_an_optimizer_built_after_backward_keeps_the_grads():
    """Before: the re-plan at construction dropped the sharded grads, so the first step changed nothing."""
    from noise_bounds import allowed, max_abs_gap

    from ragged_optim.testing import run_on_ranks

    want = dict(enumerate(run_on_ranks(_built_after_backward, 1, False)[0]))
    batched_otherwise = dict(enumerate(run_on_ranks(_built_after_backward, 1, False, 2)[0]))  # float noise
    initial = dict(enumerate(p.detach() for p in (_two_linears().a.weight, _two_linears().b.weight)))
    bound = allowed(max_abs_gap(batched_otherwise, want), scale=max(v.abs().max().item() for v in want.values()))
    assert max_abs_gap(want, initial) > 100 * bound  # the step moves the params far beyond the noise
    for got in run_on_ranks(_built_after_backward, 2, True):
        assert max_abs_gap(dict(enumerate(got)), want) <= bound


def _refused_group_run(rank, world_size, cls, add):
    from ragged_optim import full_tensor, fully_shard

    m = _two_linears()
    fully_shard(m)  # one unit: a's and b's layout is fixed by the first step
    opt = GROWN[cls](m)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1)).chunk(world_size)[rank]
    refused = None
    for step in range(4):
        m.zero_grad()
        m(x).square().sum().backward()
        if step == 2:  # the refused step changes nothing: the reference skips it
            if add:
                opt.add_param_group({"params": [m.b.weight], **({"block_size": 16} if cls is AdamW8bit else {})})
                try:
                    opt.step()
                except RuntimeError as e:
                    refused = str(e)
            continue
        opt.step()
    return refused, [full_tensor(p).detach().clone() for p in (m.a.weight, m.b.weight)], len(opt.param_groups)


@pytest.mark.parametrize("cls", [Muon, Shampoo, SOAP])
def test_a_group_refused_at_step_is_taken_back_out(cls):
    """A group added after the first step whose blocks need another layout of a unit in use is refused at the next
    step. Before, the group stayed in, and every later step raised a bare ``KeyError: 1396...`` from the block
    exchange (after advancing some step counters). Now the refused group is removed: later steps run as if it had
    never been added."""
    from ragged_optim.testing import run_on_ranks

    refused, got, n_groups = run_on_ranks(_refused_group_run, 3, cls, True)[0]
    _, want, want_groups = run_on_ranks(_refused_group_run, 3, cls, False)[0]
    assert refused and "already in use by an optimizer's state" in refused and "were removed" in refused
    assert n_groups == want_groups
    assert all(torch.equal(a, b) for a, b in zip(got, want))


BF16_OPTS = {
    Shampoo: lambda ps: Shampoo(ps, lr=0.01, max_preconditioner_dim=16, epsilon=1e-6),
    SOAP: lambda ps: SOAP(ps, lr=0.01, max_preconditioner_dim=16),
    Muon: lambda ps: Muon(ps, lr=0.02),
}


def _state_dtypes(state) -> set:
    if isinstance(state, torch.Tensor):
        return {state.dtype}
    if isinstance(state, dict):
        return set().union(*(_state_dtypes(v) for v in state.values()))
    if isinstance(state, list | tuple):
        return set().union(*(_state_dtypes(v) for v in state))
    return set()


def _bf16_run(rank, world_size, cls, path, resume):
    from ragged_optim import full_tensor, fully_shard, load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    lin = nn.Linear(24, 40).to(torch.bfloat16)
    if world_size > 1:
        fully_shard(lin)
    opt = BF16_OPTS[cls]([lin.weight])
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(40, 24, generator=gen).to(torch.bfloat16) for _ in range(4)]
    from ragged_optim.testing import set_full_grad

    for step, g in enumerate(grads):
        if resume and step == 2:
            save_checkpoint(path, lin, [opt])
            torch.manual_seed(1)
            lin2 = nn.Linear(24, 40).to(torch.bfloat16)
            if world_size > 1:
                fully_shard(lin2)
            opt2 = BF16_OPTS[cls]([lin2.weight])
            load_checkpoint(path, lin2, [opt2])
            dtypes = _state_dtypes(opt.state[lin.weight]) == _state_dtypes(opt2.state[lin2.weight])
            lin, opt = lin2, opt2
        set_full_grad(lin.weight, g)
        opt.step()
        opt.zero_grad()
    return full_tensor(lin.weight).detach().clone(), dtypes if resume else True


@pytest.mark.parametrize("cls", [Shampoo, SOAP, Muon])
def test_bf16_params_state_keeps_its_dtype_through_a_load(cls, tmp_path):
    """torch's loader casts every floating state tensor, nested ones too, to the param's dtype: a bf16 param's
    float32 Shampoo/SOAP statistics came back as bf16 from ``opt.load_state_dict`` (so from every checkpoint load),
    and the next step raised ``Input dtypes must be the same, got: input c10::BFloat16, batch1: float``. The
    resumed run must be the run that never stopped (one process and two ranks)."""
    torch.manual_seed(0)
    lin = nn.Linear(24, 40).to(torch.bfloat16)
    opt = BF16_OPTS[cls]([lin.weight])
    for _ in range(2):
        lin.weight.grad = torch.randn_like(lin.weight)
        opt.step()
    before = _state_dtypes(opt.state[lin.weight])
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert _state_dtypes(opt.state[lin.weight]) == before
    from ragged_optim.testing import run_on_ranks

    for world in (1, 2):
        want = run_on_ranks(_bf16_run, world, cls, str(tmp_path / f"w{world}"), False)[0][0]
        got, dtypes = run_on_ranks(_bf16_run, world, cls, str(tmp_path / f"w{world}"), True)[0]
        assert dtypes and torch.equal(got, want), world
