"""Fused 8-bit AdamW, torch reference: the update rule, block independence (sharded == unsharded), edges."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from noise_bounds import FACTOR, ULPS, assert_within_reference

from ragged_optim.kernels import (
    adamw8bit_constants,
    adamw8bit_m_bound,
    adamw8bit_step,
    dequantize_blockwise,
    init_adamw8bit_state,
    quantize_blockwise,
)

HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def _state_from(m: torch.Tensor, v: torch.Tensor, bs: int) -> dict:
    """The state of moments ``m`` and ``v`` (format 2: the v codes hold sqrt(v))."""
    mc, ms = quantize_blockwise(m, bs, "dynamic")
    vc, vs = quantize_blockwise(torch.from_numpy(np.sqrt(v.numpy())), bs, "dynamic_unsigned")
    return {"m_codes": mc, "m_scales": ms, "v_codes": vc, "v_scales": vs}


def _step(p, g, s, step, bs, **kw):
    adamw8bit_step(p, g, s["m_codes"], s["m_scales"], s["v_codes"], s["v_scales"], step=step, block_size=bs, **kw)


def _moments(s, bs, n):
    m = dequantize_blockwise(s["m_codes"], s["m_scales"], bs, "dynamic", n)
    r = dequantize_blockwise(s["v_codes"], s["v_scales"], bs, "dynamic_unsigned", n)
    return m, r * r


def _rand(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g), torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))


def test_init_state_is_zero():
    s = init_adamw8bit_state(1000, 128)
    m, v = _moments(s, 128, 1000)
    assert bool((m == 0).all()) and bool((v == 0).all())
    assert s["m_scales"].numel() == 8 and s["v_codes"].dtype == torch.uint8


def test_constants_are_fp32_values():
    c = adamw8bit_constants(3, 1e-3, 0.9, 0.999, 1e-8, 0.01)
    assert all(float(np.float32(x)) == x for x in c)
    decay, b1, c1, b2, c2, isb, eps, ss = c
    assert decay == pytest.approx(1 - 1e-5) and ss == pytest.approx(1e-3 / (1 - 0.9**3))
    assert isb == pytest.approx(1 / math.sqrt(1 - 0.999**3))
    with pytest.raises(ValueError, match="step"):
        adamw8bit_constants(0, 1e-3, 0.9, 0.999, 1e-8, 0.0)


def _formula(p, g, m, v, step, dtype):
    """One step of the brief's formula from moments ``m``, ``v``, every op in ``dtype``: ``(p, m, v)`` after it."""
    lr, b1, b2, eps, wd = HP["lr"], HP["beta1"], HP["beta2"], HP["eps"], HP["weight_decay"]
    p, g, m, v = (t.to(dtype) for t in (p, g, m, v))
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    bound = adamw8bit_m_bound(step, b1, b2) * v.sqrt()  # |m| <= C_t sqrt(v), as exact Adam's moments are
    m = torch.minimum(torch.maximum(m, -bound), bound)
    p = p - lr * (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)
    return p, m, v


@pytest.mark.parametrize("bs", [64, 256, 100])
def test_one_step_matches_formula(bs):
    """From the dequantized state, one step equals the brief's formula in float64, up to fp32 rounding; the new
    state is the quantization of the exact new moments, up to codes that fp32 rounding moves across a midpoint.
    How much fp32 rounding moves things depends on how the CPU evaluates the ops (fused multiply-adds, vector
    reciprocals): each gap is bounded by FACTOR x the same formula's gap when written out in float32 torch ops,
    measured here (plus ULPS ulps; and ULPS codes, as a float32 reference may happen to flip none)."""
    n = 5 * bs + 17
    p, g = _rand(n, bs)
    m0, v0 = _rand(n, bs + 1)
    v0 = v0 * v0 * 1e-2
    s = _state_from(m0, v0, bs)
    m0q, v0q = _moments(s, bs, n)
    p1 = p.clone()
    step = 4
    _step(p1, g, s, step, bs, **HP)
    pd, md, vd = _formula(p, g, m0q, v0q, step, torch.float64)
    pf, mf, vf = _formula(p, g, m0q, v0q, step, torch.float32)
    scale = pd.abs().max().item()
    ref_gap = (pf.double() - pd).abs().max().item()
    assert_within_reference((p1.double() - pd).abs().max().item(), ref_gap, scale, "8-bit kernel vs float64 step")
    want, want32 = _state_from(md.float(), vd.float(), bs), _state_from(mf, vf, bs)
    for k in ("m_codes", "v_codes"):
        flips, ref_flips = int((s[k] != want[k]).sum()), int((want32[k] != want[k]).sum())
        assert flips <= FACTOR * ref_flips + ULPS, (k, flips, ref_flips)
    for k in ("m_scales", "v_scales"):
        ref = (want32[k] - want[k]).abs().max().item()
        gap = (s[k] - want[k]).abs().max().item()
        assert_within_reference(gap, ref, want[k].abs().max().item(), f"{k} vs the float64 moments' scales")


def test_tracks_fp32_adamw():
    """Over many steps the 8-bit optimizer follows torch.optim.AdamW closely."""
    torch.manual_seed(0)
    n, bs = 4096, 256
    target = torch.randn(n)
    w8 = torch.zeros(n)
    w32 = torch.zeros(n, requires_grad=True)
    opt = torch.optim.AdamW([w32], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    s = init_adamw8bit_state(n, bs)
    for step in range(1, 201):
        noise = torch.randn(n) * 0.1
        g8 = w8 - target + noise
        _step(w8, g8, s, step, bs, lr=1e-2, weight_decay=0.01)
        w32.grad = (w32.detach() - target + noise).clone()
        opt.step()
    dev = (w8 - w32.detach()).abs()
    # measured: max 0.104, mean 0.020 (weights move ~1 over the run); distance to target 0.106 vs fp32's 0.089
    assert dev.max() < 0.15 and dev.mean() < 0.03
    assert (w8 - target).abs().mean() < 1.3 * (w32.detach() - target).abs().mean()


def test_zero_grad_and_zero_state_no_nan():
    n, bs = 600, 256
    p = torch.randn(n)
    s = init_adamw8bit_state(n, bs)
    _step(p, torch.zeros(n), s, 1, bs, lr=1e-3)
    assert not p.isnan().any()
    g = torch.zeros(n)
    g[:10] = 1.0
    for step in range(2, 5):
        _step(p, g, s, step, bs, lr=1e-3)
    assert not p.isnan().any() and not s["m_scales"].isnan().any()


@pytest.mark.parametrize("spike", [1e20, 1e30])
def test_one_huge_finite_grad_leaves_no_nan(spike):
    """A finite grad beyond ~1.8e19 made ``g * g`` overflow: v became inf, its block's scale inf, and from the next
    step every code of the block dequantized to NaN (0 * inf: elements with no grad) or inf, for good, while
    torch's AdamW trains on. Now ``(c2 * g) * g`` (torch's order) and a clamp to the largest float32 keep the
    block finite. Other blocks never see it: they equal a run without the spike, bit for bit."""
    n, bs = 512, 256
    runs = []
    for with_spike in (True, False):
        p = torch.linspace(-1, 1, n)
        s = init_adamw8bit_state(n, bs)
        for step in range(1, 6):
            g = torch.sin(torch.arange(n) * 0.37 + step) * 1e-2
            g[100:200] = 0.0  # never a gradient: v stays 0 (code 0)
            if with_spike and step == 1:
                g[5] = spike
            _step(p, g, s, step, bs, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8)
        runs.append((p, s))
    (p, s), (p_ref, _) = runs
    assert bool(torch.isfinite(p).all()) and all(bool(torch.isfinite(s[k]).all()) for k in ("m_scales", "v_scales"))
    assert torch.equal(p[bs:], p_ref[bs:])


def test_bf16_grad_equals_upcast_grad():
    n, bs = 1000, 128
    p, g = _rand(n, 3)
    g16 = g.bfloat16()
    p1, p2 = p.clone(), p.clone()
    s1, s2 = init_adamw8bit_state(n, bs), init_adamw8bit_state(n, bs)
    for step in (1, 2):
        _step(p1, g16, s1, step, bs, **HP)
        _step(p2, g16.float(), s2, step, bs, **HP)
    assert torch.equal(p1, p2) and all(torch.equal(s1[k], s2[k]) for k in s1)


@settings(max_examples=40, deadline=None)
@given(
    nblocks=st.integers(1, 12),
    bs=st.integers(1, 200),
    tail=st.integers(0, 199),
    cuts=st.lists(st.integers(0, 12), max_size=4),
    seed=st.integers(0, 2**16),
)
def test_sharded_equals_unsharded(nblocks, bs, tail, cuts, seed):
    """Stepping runs of whole blocks separately (any cut at block boundaries) is bitwise the same as one call."""
    tail = tail % bs
    n = nblocks * bs + tail
    p, g = _rand(n, seed)
    p_all = p.clone()
    s_all = init_adamw8bit_state(n, bs)
    p_parts = p.clone()
    s_parts = init_adamw8bit_state(n, bs)
    nb = s_all["m_scales"].numel()
    bounds = sorted({0, nb, *(min(c, nb) for c in cuts)})
    for step in (1, 2, 3):
        _step(p_all, g, s_all, step, bs, **HP)
        for b0, b1 in zip(bounds, bounds[1:]):
            e0, e1 = b0 * bs, min(b1 * bs, n)
            part = {k: s_parts[k][e0:e1] if "codes" in k else s_parts[k][b0:b1] for k in s_parts}
            _step(p_parts[e0:e1], g[e0:e1], part, step, bs, **HP)
    assert torch.equal(p_all, p_parts)
    assert all(torch.equal(s_all[k], s_parts[k]) for k in s_all)


def test_bad_input_messages():
    n, bs = 100, 32
    p, g = _rand(n, 0)
    s = init_adamw8bit_state(n, bs)
    with pytest.raises(ValueError, match=r"one of .*float32.*got torch.float64"):
        _step(p.double(), g, s, 1, bs, lr=1e-3)
    with pytest.raises(ValueError, match="m_scales"):
        _step(p, g, s, 1, 64, lr=1e-3)
    with pytest.raises(ValueError, match="grad"):
        _step(p, g[:50], s, 1, bs, lr=1e-3)
    with pytest.raises(ValueError, match="step"):
        _step(p, g, s, 0, bs, lr=1e-3)


def test_reference_is_vectorised():
    """The CPU reference stays vectorised: 4M params in 64-element blocks (65k blocks) cost ~0.15 s of one core; a
    Python loop over blocks would take seconds. Measured as process time on one thread (spinning OpenMP workers on a
    loaded machine would inflate it otherwise)."""
    import time

    n, bs = 4 * 2**20, 64
    p, g = torch.randn(n), torch.randn(n)
    s = init_adamw8bit_state(n, bs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _step(p, g, s, 1, bs, lr=1e-3)
        t0 = time.process_time()
        _step(p, g, s, 2, bs, lr=1e-3)
        spent = time.process_time() - t0
    finally:
        torch.set_num_threads(threads)
    assert spent < 2.0, spent


def test_an_unbounded_m_bound_is_inf_without_a_warning():
    """betas with beta1**2 > beta2 make C_t grow without limit; past float32's range it is inf by design, and
    numpy's ``RuntimeWarning: overflow encountered in cast`` came out of every step from then on."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from ragged_optim.kernels.adamw8bit import adamw8bit_m_bound_of

        assert adamw8bit_m_bound_of(1e80) == math.inf  # the running C_t**2 the optimizer keeps, past float32's max
