"""Single-device Muon: Newton-Schulz, our Muon vs torch.optim.Muon / torch.optim.AdamW, routing, errors."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from noise_bounds import assert_within_reference
from ns_reference import displacement_gap, ns_noise, torch_muon_ns_in
from torch import nn
from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

from ragged_optim.kernels.newton_schulz import (
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_EPS,
    DEFAULT_NS_STEPS,
    newton_schulz,
)
from ragged_optim.optim import Muon, muon_param_groups

SHAPES = [(24, 8), (8, 24), (16, 16), (16, 16), (1, 12), (12, 1), (33, 17)]  # tall, wide, square x2, 1xN, Nx1


def spy_baddbmm(monkeypatch) -> list[int]:
    """Record the batch size of every ``torch.baddbmm`` call: only newton_schulz's batched path makes them."""
    sizes: list[int] = []
    real = torch.baddbmm

    def spy(input, batch1, batch2, *args, **kwargs):
        sizes.append(batch1.shape[0])
        return real(input, batch1, batch2, *args, **kwargs)

    monkeypatch.setattr(torch, "baddbmm", spy)
    return sizes


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def make_params(shapes, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


def clone_params(ps):
    return [p.detach().clone().requires_grad_() for p in ps]


def run_steps(opts, param_lists, steps, seed=1):
    """Feed the same random grads to every (optimizer, params) pair for ``steps`` steps."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in param_lists[0]]
        for ps in param_lists:
            for p, gr in zip(ps, grads):
                p.grad = gr.clone()
        for o in opts:
            o.step()


# --------------------------------------------------------------------------- Newton-Schulz


@pytest.mark.parametrize("shape", SHAPES + [(64, 128), (128, 64)])
def test_ns_2d_bitwise_equals_torch(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    ours = newton_schulz(G, matmul="native")
    theirs = torch_ns(G.clone(), (3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert ours.dtype == G.dtype and theirs.dtype == torch.bfloat16
    assert torch.equal(ours, theirs.float())


def test_ns_does_not_modify_input_and_keeps_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        G = torch.randn(2, 6, 4, dtype=dtype)
        G0 = G.clone()
        for ns_dtype in (torch.bfloat16, torch.float32):
            out = newton_schulz(G, dtype=ns_dtype)
            assert out.dtype == dtype and out.shape == G.shape
            assert torch.equal(G, G0)
        # 2-D input already in the compute dtype (bf16 in bf16): torch's routine divides it in place; we must not
        M = G[0].clone()
        M0 = M.clone()
        for ns_dtype in (torch.bfloat16, torch.float32):
            for matmul in ("native", "upcast"):
                out2 = newton_schulz(M, dtype=ns_dtype, matmul=matmul)
                assert out2.dtype == dtype and out2.shape == (6, 4)
                assert torch.equal(M, M0), (dtype, ns_dtype, matmul)


@settings(max_examples=20, deadline=None)
@given(
    batch=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    m=st.integers(1, 24),
    n=st.integers(1, 24),
    fp32=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_ns_batched_equals_per_matrix(batch, m, n, fp32, seed):
    dtype = torch.float32 if fp32 else torch.bfloat16
    G = torch.randn(*batch, m, n, generator=torch.Generator().manual_seed(seed))
    out = newton_schulz(G, dtype=dtype)
    flat = G.reshape(-1, m, n)
    each = torch.stack([newton_schulz(x, dtype=dtype) for x in flat]).reshape(G.shape)
    assert torch.equal(out, each)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ns_batched_matmul_option_close(dtype, monkeypatch):
    """baddbmm sums each product in another order than addmm, so the two can differ by rounding in ``dtype``,
    amplified by the iterations: bounded by the distance an independent NS in ``dtype`` has from float64 on the same
    matrices, measured here (tests/support/ns_reference.py; measured on this CPU: bf16 0 vs 3.7e-2, fp32 1.2e-6 vs
    1.4e-6)."""
    G = torch.randn(4, 3, 20, 9, generator=torch.Generator().manual_seed(4))
    sizes = spy_baddbmm(monkeypatch)
    b = newton_schulz(G, dtype=dtype)
    assert sizes == []  # default: one matrix at a time (addmm)
    a = newton_schulz(G, dtype=dtype, batched_matmul=True)
    assert sizes == [12] * (2 * DEFAULT_NS_STEPS)  # two baddbmm per iteration, each over all 4*3 matrices
    noise = ns_noise(list(G.reshape(-1, 20, 9)), dtype)
    assert_within_reference(rel_diff(a, b), noise, 1.0, f"batched vs per-matrix NS in {dtype}")


def test_ns_orthogonalizes():
    G = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(newton_schulz(G, dtype=torch.float32))
    assert s.min() > 0.5 and s.max() < 1.3
    assert torch.equal(newton_schulz(torch.zeros(4, 3)), torch.zeros(4, 3))


# --------------------------------------------------------------------------- vs torch.optim.Muon


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_matches_torch_muon(nesterov, weight_decay, adjust_lr, capsys):
    ps = make_params(SHAPES)
    qs = clone_params(ps)
    kw = dict(lr=0.02, momentum=0.9, nesterov=nesterov, weight_decay=weight_decay)
    ours = Muon(ps, adjust_lr=adjust_lr, ns_matmul="native", **kw)
    theirs = torch.optim.Muon(qs, adjust_lr_fn=adjust_lr, **kw)
    run_steps([ours, theirs], [ps, qs], steps=6)
    worst = max(rel_diff(p, q) for p, q in zip(ps, qs))
    with capsys.disabled():
        print(f"\n[muon vs torch] nesterov={nesterov} wd={weight_decay} {adjust_lr}: max rel diff {worst:.3g}")
    # Same op sequence; on CPU the same-shape batch (two 16x16 params) is bitwise equal to torch's per-matrix addmm.
    for p, q in zip(ps, qs):
        assert torch.equal(p, q), (tuple(p.shape), rel_diff(p, q))
    for p, q in zip(ps, qs):
        assert torch.equal(ours.state[p]["momentum_buffer"], theirs.state[q]["momentum_buffer"])


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_pure_muon_update_is_torch_muon(nesterov, weight_decay, adjust_lr):
    """``muon_update``, the algorithm as one function of one matrix (no optimizer class), steps as
    ``torch.optim.Muon`` does: params and momentum buffers bit for bit over 4 steps."""
    from ragged_optim.optim.muon import NewtonSchulzSettings, muon_update

    ps = make_params(SHAPES)
    qs = clone_params(ps)
    bufs = [torch.zeros_like(p) for p in ps]
    theirs = torch.optim.Muon(qs, lr=0.02, momentum=0.9, nesterov=nesterov, weight_decay=weight_decay,
                              adjust_lr_fn=adjust_lr)  # fmt: skip
    ns = NewtonSchulzSettings(DEFAULT_NS_STEPS, tuple(DEFAULT_NS_COEFFICIENTS), DEFAULT_NS_EPS, torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=gen) for p in ps]
        with torch.no_grad():
            for p, g, b in zip(ps, grads, bufs):
                muon_update(p, g, b, lr=0.02, momentum=0.9, nesterov=nesterov, weight_decay=weight_decay,
                            adjust_lr_mode=adjust_lr, ns=ns, matmul="native")  # fmt: skip
        for q, g in zip(qs, grads):
            q.grad = g.clone()
        theirs.step()
    for p, q, b in zip(ps, qs, bufs):
        assert torch.equal(p, q), (tuple(p.shape), rel_diff(p, q))
        assert torch.equal(b, theirs.state[q]["momentum_buffer"])


def test_fp32_ns_tracks_float64_muon_and_bf16_gap(capsys):
    """ns_dtype=float32 (torch has no such option) against torch.optim.Muon with its iteration in float64
    (tests/support/ns_reference.py): the gap is fp32 rounding inside NS, bounded by the gap torch.optim.Muon with the
    same iteration in float32 has from the float64 one in the same run. bf16 with native matmuls is torch's Muon bit for
    bit. The bf16-vs-fp32 gaps (one update; params after 10 steps) are printed: BF16_NS_REL_TOL documents them."""
    shapes = SHAPES + [(64, 32)]
    ps = make_params(shapes)
    p0 = [p.detach().clone() for p in ps]
    qs, rs, xs, ys = (clone_params(ps) for _ in range(4))
    kw = dict(lr=0.02, weight_decay=0.01)
    fp32 = Muon(ps, ns_dtype=torch.float32, **kw)
    bf16 = Muon(rs, ns_matmul="native", **kw)
    ref = torch.optim.Muon(qs, **kw)
    run_steps([fp32, bf16, ref], [ps, qs, rs], steps=10)
    with torch_muon_ns_in(torch.float64):
        run_steps([torch.optim.Muon(xs, **kw)], [xs], steps=10)
    with torch_muon_ns_in(torch.float32):
        run_steps([torch.optim.Muon(ys, **kw)], [ys], steps=10)
    for r, q in zip(rs, qs):
        assert torch.equal(r, q)
    assert_within_reference(
        displacement_gap(ps, xs, p0), displacement_gap(ys, xs, p0), 1.0, "fp32-NS Muon vs float64-NS torch Muon"
    )
    worst = displacement_gap(ps, qs, p0)
    one = max(
        rel_diff(newton_schulz(G, dtype=torch.bfloat16, matmul="native"), newton_schulz(G, dtype=torch.float32))
        for G in (torch.randn(s, generator=torch.Generator().manual_seed(7)) for s in SHAPES + [(256, 512)])
    )
    with capsys.disabled():
        print(f"\n[bf16 vs fp32 NS] one update: {one:.3g}; params after 10 steps (rel. to displacement): {worst:.3g}")


def test_stack_equals_each_matrix_and_conv_equals_flattened():
    stack = make_params([(3, 12, 5)])[0]
    mats = [stack.detach()[e].clone().requires_grad_() for e in range(3)]
    conv = make_params([(6, 2, 3, 3)], seed=5)[0]
    flat = conv.detach().reshape(6, 18).clone().requires_grad_()
    o1 = Muon([stack, conv], weight_decay=0.1, adjust_lr="match_rms_adamw")
    o2 = Muon([*mats, flat], weight_decay=0.1, adjust_lr="match_rms_adamw")
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        gs = torch.randn(stack.shape, generator=g)
        gc = torch.randn(conv.shape, generator=g)
        stack.grad, conv.grad = gs.clone(), gc.clone()
        for e in range(3):
            mats[e].grad = gs[e].clone()
        flat.grad = gc.reshape(6, 18).clone()
        o1.step()
        o2.step()
    assert torch.equal(stack.detach(), torch.stack([m.detach() for m in mats]))
    assert torch.equal(conv.detach().reshape(6, 18), flat.detach())
    assert o1._matrix_shape(stack) == (12, 5) and o1._matrix_shape(conv) == (6, 18)


# --------------------------------------------------------------------------- AdamW path


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_adamw_group_equals_torch_adamw(weight_decay):
    ps = make_params([(7,), (3, 5), (1,), ()])
    qs = clone_params(ps)
    hp = dict(lr=1e-3, betas=(0.8, 0.99), eps=1e-8, weight_decay=weight_decay)
    ours = Muon([{"params": ps, "use_muon": False, **hp}])
    theirs = torch.optim.AdamW(qs, **hp)
    run_steps([ours, theirs], [ps, qs], steps=5)
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ours.state[p][k], theirs.state[q][k])


def test_default_split_by_ndim_uses_adamw_defaults():
    w, b = make_params([(8, 4), (8,)])
    w2, b2 = clone_params([w, b])
    ours = Muon(
        [w, b],
        lr=0.03,
        adamw_lr=1e-2,
        adamw_betas=(0.9, 0.9),
        adamw_eps=1e-9,
        adamw_weight_decay=0.1,
        ns_matmul="native",
    )
    assert [g["use_muon"] for g in ours.param_groups] == [True, False]
    assert ours.param_groups[1]["lr"] == 1e-2 and "momentum" not in ours.param_groups[1]
    ref_m = torch.optim.Muon([w2], lr=0.03, weight_decay=0.0)
    ref_a = torch.optim.AdamW([b2], lr=1e-2, betas=(0.9, 0.9), eps=1e-9, weight_decay=0.1)
    run_steps([ours, ref_m, ref_a], [[w, b], [w2, b2]], steps=3)
    assert torch.equal(w, w2) and torch.equal(b, b2)


def test_group_overrides_in_split_group():
    w, b = make_params([(8, 4), (8,)])
    opt = Muon([{"params": [w, b], "lr": 0.05, "adamw_lr": 1e-3, "tag": "x"}])
    muon_g, adam_g = opt.param_groups
    assert muon_g["lr"] == 0.05 and adam_g["lr"] == 1e-3 and adam_g["eps"] == 1e-10
    assert muon_g["tag"] == adam_g["tag"] == "x"


# --------------------------------------------------------------------------- machinery


def test_only_1d_params_warn_and_take_adamw():
    b1, b2 = make_params([(8,), (3,)])
    with pytest.warns(UserWarning, match="no matrix params: all 2 params"):
        opt = Muon([b1, b2])
    assert [g["use_muon"] for g in opt.param_groups] == [False]
    ref = torch.optim.AdamW(clone_params([b1, b2]), lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)
    run_steps([opt, ref], [[b1, b2], ref.param_groups[0]["params"]], steps=2)
    assert all(torch.equal(p, q) for p, q in zip([b1, b2], ref.param_groups[0]["params"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Muon([{"params": [b1], "use_muon": False}])  # explicit: no warning
        Muon([b1, make_params([(4, 4)])[0]])  # a matrix among them: no warning


def test_no_grad_params_skipped():
    w, v, b, u = make_params([(8, 4), (4, 4), (3,), (4, 4)])
    v0, u0 = v.detach().clone(), u.detach().clone()
    opt = Muon([{"params": [w, v, b]}, {"params": [u]}])  # the second group: no grad at all
    w.grad = torch.randn_like(w)
    opt.step()
    assert torch.equal(v, v0) and v not in opt.state and b not in opt.state and w in opt.state
    assert torch.equal(u, u0) and u not in opt.state


def test_state_dict_roundtrip_and_scheduler():
    ps = make_params([(8, 4), (6,), (4, 4, 2)])
    qs = clone_params(ps)
    full = Muon(ps, weight_decay=0.1)
    run_steps([full], [ps], steps=4, seed=9)

    part = Muon(qs, weight_decay=0.1)
    g = torch.Generator().manual_seed(9)
    for k in range(4):
        grads = [torch.randn(p.shape, generator=g) for p in qs]
        for q, gr in zip(qs, grads):
            q.grad = gr
        part.step()
        if k == 1:  # save, rebuild, reload in the middle
            sd = copy.deepcopy(part.state_dict())
            part = Muon(qs, lr=1.0, weight_decay=0.5)
            part.load_state_dict(sd)
            assert part.param_groups[0]["lr"] == 0.02 and part.param_groups[0]["weight_decay"] == 0.1
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)

    sched = torch.optim.lr_scheduler.StepLR(full, step_size=1, gamma=0.5)
    lrs = [g["lr"] for g in full.param_groups]
    run_steps([full], [ps], steps=1)
    sched.step()
    assert [g["lr"] for g in full.param_groups] == [x * 0.5 for x in lrs]


# --------------------------------------------------------------------------- errors


def test_errors_name_the_param_and_the_fix():
    w, b = make_params([(4, 4), (4,)])
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] with shape \(4,\).*use_muon=False"):
        Muon([{"params": [w, b], "use_muon": True}])
    with pytest.raises(ValueError, match=r"'bias'.*1-D"):
        Muon([{"params": [("weight", w), ("bias", b)], "use_muon": True}])
    c = torch.randn(4, 4, dtype=torch.complex64, requires_grad=True)
    with pytest.raises(ValueError, match=r"complex.*torch.optim.AdamW"):
        Muon([c])
    with pytest.raises(ValueError, match="adjust_lr"):
        Muon([w], adjust_lr="bogus")
    with pytest.raises(ValueError, match="momentum"):
        Muon([w], momentum=1.5)
    with pytest.raises(TypeError, match="list"):
        Muon([{"params": {w}}])
    opt = Muon([w, b])
    w.grad = torch.randn(4, 4).to_sparse()
    with pytest.raises(ValueError, match=r"\['params'\]\[0\] with shape \(4, 4\) has a sparse gradient.*sparse=False"):
        opt.step()
    emb = nn.Embedding(10, 4, sparse=True)
    opt = Muon([{"params": emb.parameters(), "use_muon": False}])
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse gradient"):
        opt.step()
    # a failed add_param_group leaves the optimizer unchanged
    opt = Muon([w])
    with pytest.raises(ValueError):
        opt.add_param_group({"params": [b], "use_muon": True})
    assert len(opt.param_groups) == 1


# --------------------------------------------------------------------------- routing


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)


class TinyGPT(nn.Module):
    def __init__(self, vocab=50, d=16, layers=2, tie=True, head_name="lm_head"):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(32, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        setattr(self, head_name, nn.Linear(d, vocab, bias=False))
        if tie:
            getattr(self, head_name).weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = x + blk.proj(blk.qkv(blk.ln1(x))[..., : x.shape[-1]])
            x = x + blk.out(torch.relu(blk.fc(blk.ln2(x))))
        return self.lm_head(self.ln_f(x))


def _names(model, params):
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_muon_param_groups_tiny_gpt():
    model = TinyGPT()
    groups = muon_param_groups(model, lr=0.01, weight_decay=0.1, adamw_lr=1e-3, adamw_betas=(0.9, 0.99))
    muon, adamw = groups
    assert muon["use_muon"] and not adamw["use_muon"]
    assert muon["lr"] == 0.01 and muon["weight_decay"] == 0.1 and adamw["lr"] == 1e-3 and adamw["betas"] == (0.9, 0.99)
    expected_muon = {f"blocks.{i}.{m}.weight" for i in range(2) for m in ("qkv", "proj", "fc", "out")}
    assert _names(model, muon["params"]) == expected_muon
    assert "wte.weight" in _names(model, adamw["params"]) and "wpe.weight" in _names(model, adamw["params"])
    all_params = muon["params"] + adamw["params"]
    assert len(all_params) == len({id(p) for p in all_params}) == len(list(model.parameters()))  # tied once

    opt = Muon(groups)
    loss = model(torch.randint(0, 50, (2, 8))).logsumexp(-1).mean()
    loss.backward()
    opt.step()


def test_muon_param_groups_head_rules_and_exclude():
    untied = TinyGPT(tie=False)
    _, adamw = muon_param_groups(untied)
    assert "lm_head.weight" in _names(untied, adamw["params"])

    class Odd(nn.Module):  # untied head under another name: caught as the last Linear with out_features == vocab
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(40, 8)
            self.hidden = nn.Linear(8, 8)
            self.to_vocab = nn.Linear(8, 40)

    odd = Odd()
    muon, adamw = muon_param_groups(odd)
    assert muon["params"] == [odd.hidden.weight]
    assert "to_vocab.weight" in _names(odd, adamw["params"])
    for exclude in (["hidden.weight"], ["hidden"], [odd.hidden], [odd.hidden.weight]):
        (only,) = muon_param_groups(odd, exclude=exclude)  # empty Muon group left out
        assert only["use_muon"] is False and len(only["params"]) == 5
    with pytest.raises(ValueError, match="neither a param nor a module"):
        muon_param_groups(odd, exclude=["nope"])


@pytest.mark.parametrize("batched", [True, False])
def test_seam_orthogonalize_calls_per_step_and_batched_matmul_option(batched, capsys, monkeypatch):
    calls = []
    sizes = spy_baddbmm(monkeypatch)

    class Recording(Muon):
        ns_batched_matmul = batched

        def _orthogonalize_updates(self, items):
            calls.append([tuple(it.param.shape) for it in items])
            assert all(it.update.shape == it.param.shape for it in items)
            return super()._orthogonalize_updates(items)

    ps = make_params(SHAPES)
    qs = clone_params(ps)
    qs0 = clone_params(ps)
    groups = [{"params": ps[:3], "use_muon": True}, {"params": ps[3:], "use_muon": True, "lr": 0.02}]
    ours = Recording(groups, ns_matmul="native")
    theirs = torch.optim.Muon(qs, lr=0.02, weight_decay=0.0)
    run_steps([ours, theirs], [ps, qs], steps=3)
    if batched:  # all groups in one call per step, so that same-shape matrices can share a batch
        assert calls == [[tuple(s) for s in SHAPES]] * 3
    else:  # plain tensors have no cut matrices: each param alone, right after its momentum (one update alive)
        assert calls == [[tuple(s)] for s in SHAPES] * 3
    # Only the two 16x16 params share a shape: with the option on, they go through baddbmm as one batch of 2
    # (2 calls per NS iteration, 3 steps); every other matrix is alone and takes the 2-D path.
    assert sizes == ([2] * (2 * DEFAULT_NS_STEPS * 3) if batched else [])
    worst = max(rel_diff(p, q) for p, q in zip(ps, qs))
    with capsys.disabled():
        print(f"\n[muon vs torch, ns_batched_matmul={batched}] max rel diff {worst:.3g}")
    if not batched:  # the same op sequence as torch's, matrix by matrix
        assert all(torch.equal(p, q) for p, q in zip(ps, qs))
        return
    # baddbmm sums in another order than torch's addmm: bf16 rounding noise, bounded by the distance torch's own
    # bf16 Muon has from the same Muon with float64 Newton-Schulz, same grads, measured here (both relative to how
    # far the params moved: relative to the params themselves, even a wrong NS coefficient would hide)
    xs = clone_params(qs0)
    with torch_muon_ns_in(torch.float64):
        run_steps([torch.optim.Muon(xs, lr=0.02, weight_decay=0.0)], [xs], steps=3)
    noise = displacement_gap(qs, xs, qs0)
    assert_within_reference(displacement_gap(ps, qs, qs0), noise, 1.0, "batched-matmul Muon vs torch.optim.Muon")


def test_step_peak_memory_no_more_than_torch_muon():
    """A step keeps one Muon update alive at a time, as torch.optim.Muon does (it once kept every param's update
    until all were orthogonalized: the whole model's matrices again). Measured against torch's step on the same
    params and grads, in the same run (CPU allocator events). The default batches small same-shape matrices (up to
    8 a call): its peak is a few small matrices more than torch's, and does not grow with the number of params."""
    from ragged_optim.memory import peak_bytes

    def step_peak(n, make):
        shapes = [(96, 64)] * n
        ps = make_params(shapes)
        grads = [torch.randn(s, generator=torch.Generator().manual_seed(7 + i)) for i, s in enumerate(shapes)]
        opt = make(ps)
        for _ in range(2):  # the second step: state exists, only the step's temporaries are allocated
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            _, peak = peak_bytes(opt.step)
        return peak, ps

    def per_matrix(ps):
        opt = Muon(ps, ns_matmul="native")
        opt.ns_batched_matmul = False
        return opt

    torch_peak, qs = step_peak(8, lambda ps: torch.optim.Muon(ps, lr=0.02, weight_decay=0.0))
    one_peak, ps = step_peak(8, per_matrix)
    assert all(torch.equal(p, q) for p, q in zip(ps, qs))
    default_peaks = [step_peak(n, lambda ps: Muon(ps, ns_matmul="native"))[0] for n in (8, 32)]
    one_update = 96 * 64 * 4
    print(
        f"\n[muon step peak] one at a time {one_peak} B, batched by default {default_peaks} B (8, 32 params), "
        f"torch.optim.Muon {torch_peak} B, one fp32 update {one_update} B"
    )
    assert one_peak <= torch_peak, (one_peak, torch_peak)
    assert default_peaks[1] <= default_peaks[0], default_peaks  # bounded by one batch, not by the model
    assert default_peaks[0] <= torch_peak + 8 * 3 * one_update, (default_peaks, torch_peak)


def test_default_batches_small_same_shape_matrices_with_torchs_bits(monkeypatch):
    """On a CPU a small matrix's Newton-Schulz is mostly oneDNN's fixed cost per call: the small GPT's Muon step took
    1.03x torch.optim.Muon's with one call per matrix, 0.81x with batches (issue 18). By default, same-shape small
    matrices share batched calls of up to 8, where the batched call is probed to give each matrix its own result
    exactly: params and momentum stay torch.optim.Muon's, bit for bit."""
    from ragged_optim.kernels.newton_schulz import batched_is_exact

    shapes = [(32, 32)] * 11 + [(48, 32)] * 3 + [(33, 40), (300, 300)] + [(16, 16)] * 3
    kw = dict(steps=DEFAULT_NS_STEPS, coefficients=DEFAULT_NS_COEFFICIENTS, eps=DEFAULT_NS_EPS, dtype=torch.bfloat16)
    exact = {(k, m, n): batched_is_exact(k, m, n, torch.bfloat16, "cpu", **kw, matmul="native") for k, m, n in
             [(8, 32, 32), (3, 32, 32), (3, 48, 32)]}  # fmt: skip
    ps = make_params(shapes)
    qs = clone_params(ps)
    sizes = spy_baddbmm(monkeypatch)  # (after the probes: they are cached per shape and process)
    ours = Muon(ps, ns_matmul="native", weight_decay=0.1)
    theirs = torch.optim.Muon(qs, lr=0.02, weight_decay=0.1)
    run_steps([ours, theirs], [ps, qs], steps=3)
    per_step = [k for (k, _, _), ok in exact.items() if ok]  # 11 squares: a batch of 8, one of 3; 3 tall ones
    print(f"\n[muon default batches] probed exact here: {exact}")
    # the (33, 40) and (300, 300) alone; the 16x16s too: torch runs their 2-D matmuls outside oneDNN
    assert sorted(sizes) == sorted(per_step * 2 * DEFAULT_NS_STEPS * 3)
    for p, q in zip(ps, qs):
        assert torch.equal(p, q), tuple(p.shape)
        assert torch.equal(ours.state[p]["momentum_buffer"], theirs.state[q]["momentum_buffer"])


def test_default_batches_only_where_the_probe_finds_them_exact(monkeypatch):
    """A backend whose batched matmul rounds otherwise (simulated: 1 ulp added to baddbmm's result) fails the probe,
    and the default falls back to one call per matrix: still torch.optim.Muon's bits."""
    from ragged_optim.kernels import newton_schulz as ns

    real = torch.baddbmm

    def off_by_an_ulp(*args, **kwargs):
        out = real(*args, **kwargs)
        return torch.nextafter(out, torch.full_like(out, float("inf")))

    monkeypatch.setattr(torch, "baddbmm", off_by_an_ulp)
    ns._probe_batched.cache_clear()
    try:
        assert not ns.batched_is_exact(
            4, 32, 32, torch.float32, "cpu", steps=5, coefficients=(3.4, -4.7, 2.0), eps=1e-7, dtype=torch.bfloat16,
            matmul="native",
        )  # fmt: skip
        ps = make_params([(32, 32)] * 4)
        qs = clone_params(ps)
        run_steps([Muon(ps, ns_matmul="native"), torch.optim.Muon(qs, lr=0.02, weight_decay=0.0)], [ps, qs], steps=2)
        assert all(torch.equal(p, q) for p, q in zip(ps, qs))
    finally:
        ns._probe_batched.cache_clear()  # the next tests probe the real kernels again


@pytest.mark.parametrize(
    "kw",
    [{"ns_matmul": "upcast"}, {"ns_matmul": "native"}, {"ns_dtype": torch.float32}, {"nesterov": False}],
    ids=["upcast", "native", "fp32", "no-nesterov"],
)
def test_whole_param_path_equals_block_api_path(kw):
    """A param held whole skips map_blocks (Newton-Schulz on the update, ``p.add_`` from its ns_dtype result); a
    subclass that overrides phase (c) keeps every param on the block-API path; one that overrides phase (a) has it
    called per param instead of step()'s foreach momentum (forced with ``foreach=True``: a CPU's default is per
    param). All give the same bits, for 2-D, 3-D stacks and 4-D params."""

    class BlockPath(Muon):
        def _apply_muon_update(self, item, ortho):
            return super()._apply_muon_update(item, ortho)

    class PerParamMomentum(Muon):  # phase (a) one param at a time, not step()'s foreach ops
        calls = 0

        def _local_muon_update(self, p, grad, group, key=None):
            PerParamMomentum.calls += 1
            return super()._local_muon_update(p, grad, group, key=key)

    shapes = [(24, 8), (8, 24), (16, 16), (3, 12, 5), (6, 2, 2, 3), (7,), (1,)]  # the 1-D ones: AdamW
    ps = make_params(shapes)
    qs, rs, fs = clone_params(ps), clone_params(ps), clone_params(ps)
    opts = [Muon(ps, weight_decay=0.1, **kw), BlockPath(qs, weight_decay=0.1, **kw)]
    opts += [PerParamMomentum(rs, weight_decay=0.1, **kw), Muon(fs, weight_decay=0.1, foreach=True, **kw)]
    run_steps(opts, [ps, qs, rs, fs], steps=3)
    assert PerParamMomentum.calls == 3 * (len(shapes) - 2)
    assert all(torch.equal(p, q) and torch.equal(p, r) and torch.equal(p, f) for p, q, r, f in zip(ps, qs, rs, fs))


def test_foreach_option_same_bits_and_checked():
    """``foreach`` True / False / None (per param on a CPU for the momentum, foreach for AdamW) give the same bits;
    anything else is refused by name."""
    shapes = [(24, 8), (16, 16), (7,), (5,), (3, 4)]
    runs = []
    for foreach in (None, True, False):
        ps = make_params(shapes)
        run_steps([Muon([{"params": ps[:2]}, {"params": ps[2:], "use_muon": False}], foreach=foreach)], [ps], 3)
        runs.append(ps)
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))
    with pytest.raises(ValueError, match="foreach must be None, True or False, got 'yes'"):
        Muon(make_params(shapes), foreach="yes")


class _Parametrized(nn.Module):
    def __init__(self):
        super().__init__()
        from torch.nn.utils import parametrizations

        torch.manual_seed(0)
        self.emb = nn.Embedding(40, 8)
        self.hidden = parametrizations.weight_norm(nn.Linear(8, 8))
        self.to_vocab = nn.Linear(8, 40)
        nn.utils.parametrize.register_parametrization(self.emb, "weight", _Scaled())


class _Scaled(nn.Module):
    def forward(self, w):
        return 2 * w


def _groups_of_parametrized(rank, world_size):
    from ragged_optim import fully_shard

    model = _Parametrized()
    fully_shard(model)
    return [sorted(_names(model, g["params"])) for g in muon_param_groups(model)]


def test_muon_param_groups_reads_no_parametrized_weight():
    """``module.weight`` of a parametrized module runs its parametrization; on a sharded model that is garbage on
    1-D pieces, and weight_norm's kernel read past its buffers: ``free(): corrupted unsorted chunks``, the ranks
    died. The groups come from the params themselves: a weight-normed hidden Linear's g and v by shape, a
    parametrized embedding's original with AdamW, the same with and without sharding."""
    from ragged_optim.testing import run_on_ranks

    plain = _Parametrized()
    want = [sorted(_names(plain, g["params"])) for g in muon_param_groups(plain)]
    assert want[0] == [f"hidden.parametrizations.weight.original{i}" for i in (0, 1)]  # g is (8, 1): 2-D
    assert "emb.parametrizations.weight.original" in want[1]
    assert run_on_ranks(_groups_of_parametrized, 2) == [want, want]


def test_default_batches_hold_no_lone_shape_and_stay_small_for_many_shapes(monkeypatch):
    """A matrix whose shape no other shares is not batched and does not wait: a model of 48 distinct small shapes
    steps at the per-matrix path's peak (before: every shape kept an 8-slot bf16 buffer until the step's end, 6.4 MB
    against 0.13 MB for 64 shapes). Same-shape ones still batch, bitwise the per-matrix result."""
    from ragged_optim.memory import peak_bytes

    sizes = spy_baddbmm(monkeypatch)

    def step_peak(shapes, batched):
        ps = make_params(shapes)
        opt = Muon(ps, ns_matmul="native")
        if not batched:
            opt.ns_batched_matmul = False
        grads = [torch.randn(s, generator=torch.Generator().manual_seed(7 + i)) for i, s in enumerate(shapes)]
        for _ in range(2):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            _, peak = peak_bytes(opt.step)
        return peak, ps

    distinct = [(64, 64 + k) for k in range(48)]
    (default_peak, ps), (one_peak, qs) = step_peak(distinct, True), step_peak(distinct, False)
    print(f"\n[muon distinct shapes] step peak default {default_peak} B, one at a time {one_peak} B")
    assert sizes == [] and default_peak <= one_peak, (sizes, default_peak, one_peak)
    assert all(torch.equal(p, q) for p, q in zip(ps, qs))


def test_a_bad_grad_in_a_later_group_changes_nothing():
    """Every grad is checked before anything changes: a sparse grad in the last group raises with every param and
    momentum buffer as they were (before, the earlier groups had stepped: a partial step)."""
    g = torch.Generator().manual_seed(0)
    ws = [torch.nn.Parameter(torch.randn(64, 64, generator=g)) for _ in range(4)]
    bias = torch.nn.Parameter(torch.randn(10, 4, generator=g))
    opt = Muon([{"params": ws}, {"params": [bias], "use_muon": False}], ns_matmul="native")
    for w in ws:
        w.grad = torch.randn(64, 64, generator=g)
    bias.grad = torch.randn(10, 4, generator=g).to_sparse()
    before = [w.detach().clone() for w in ws]
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\].*sparse gradient"):
        opt.step()
    assert all(torch.equal(b, w) for b, w in zip(before, ws))
    assert not any(opt.state[w] for w in ws)


def test_a_subclass_finish_whole_param_sees_every_whole_param():
    """A subclass that overrides ``_finish_whole_param`` keeps every param it holds whole on that path: the default's
    small-matrix batches would pass it by."""
    calls = []

    class Custom(Muon):
        def _finish_whole_param(self, item, ns_kw, lr, decay=1.0):
            calls.append(tuple(item.param.shape))
            return super()._finish_whole_param(item, ns_kw, lr, decay)

    ps = make_params([(64, 64)] * 3 + [(48, 32)] * 2)
    qs = clone_params(ps)
    run_steps([Custom(ps, ns_matmul="native"), torch.optim.Muon(qs, lr=0.02, weight_decay=0.0)], [ps, qs], steps=2)
    assert len(calls) == 5 * 2, calls
    assert all(torch.equal(p, q) for p, q in zip(ps, qs))


def test_the_probe_takes_a_missing_batched_kernel_for_not_exact(monkeypatch):
    """A backend without the batched kernel (simulated: baddbmm raises) makes the probe say no, and the default runs
    one call per matrix; before, every step raised, after the momentum had moved."""
    from ragged_optim.kernels import newton_schulz as ns

    def missing(*args, **kwargs):
        raise NotImplementedError("baddbmm: no kernel for this backend")

    monkeypatch.setattr(torch, "baddbmm", missing)
    ns._probe_batched.cache_clear()
    try:
        ps = make_params([(64, 64)] * 4)
        qs = clone_params(ps)
        run_steps([Muon(ps, ns_matmul="native"), torch.optim.Muon(qs, lr=0.02, weight_decay=0.0)], [ps, qs], steps=2)
        assert all(torch.equal(p, q) for p, q in zip(ps, qs))
    finally:
        ns._probe_batched.cache_clear()


def test_small_matrix_buckets_never_hold_more_than_their_byte_cap(monkeypatch):
    """What waits for a batch (the open buckets' slots) stays under ``SMALL_BATCH_MAX_BYTES`` (4 MiB: one full batch
    of the largest batchable matrix), here lowered to 3 slots of 64x64 so that interleaved shapes pass it: the
    fullest bucket goes first, and the results stay torch.optim.Muon's bits."""
    from ragged_optim.optim import muon_batches

    cap = 3 * 64 * 64 * 2
    monkeypatch.setattr(muon_batches, "SMALL_BATCH_MAX_BYTES", cap)
    held = []
    real_add = muon_batches.SmallMatrixBatches.add

    def add(self, *args, **kwargs):
        taken = real_add(self, *args, **kwargs)
        held.append(sum(b.slots.numel() * b.slots.element_size() for b in self._buckets.values()))
        return taken

    monkeypatch.setattr(muon_batches.SmallMatrixBatches, "add", add)
    sizes = spy_baddbmm(monkeypatch)
    ps = make_params([(64, 64), (64, 48)] * 4)
    qs = clone_params(ps)
    run_steps([Muon(ps, ns_matmul="native"), torch.optim.Muon(qs, lr=0.02, weight_decay=0.0)], [ps, qs], steps=2)
    assert all(torch.equal(p, q) for p, q in zip(ps, qs))
    assert held and max(held) <= cap, (max(held), cap)
    assert sizes, "the buckets still batched"
