"""One-process SOAP: an independent dense float64 reference written from the paper's update equations, bands as
independent SOAPs, 1-D params as Adam, numerics, errors and state dicts (the sharded runs: test_soap_sharded.py)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from noise_bounds import assert_within_reference, rel

import ragged_optim as ro
from ragged_optim.optim.soap import SOAP

# ----------------------------------------------------------------------------------------------- the reference


def _descending_eigenvectors(a: torch.Tensor) -> torch.Tensor:
    """Eigenvectors of symmetric ``a`` by descending eigenvalue, each column's sign fixed so that its largest entry
    is positive (a convention the optimizer does not use: SOAP's update must not depend on the signs)."""
    lam, q = torch.linalg.eigh(a)
    q = q[:, torch.argsort(lam, descending=True)]
    return q * torch.sign(q.gather(0, q.abs().argmax(0, keepdim=True)))


def _power_qr(factor, q, v, dim):
    """The paper's basis refresh: order the columns by the eigenvalues they estimate (descending), permute the
    rotated second moment with them, one power-iteration step, orthonormalise (R with a positive diagonal)."""
    est = torch.stack([q[:, i] @ factor @ q[:, i] for i in range(q.shape[1])])
    order = torch.argsort(est, descending=True)
    qq, rr = torch.linalg.qr(factor @ q[:, order])
    return qq * torch.sign(torch.diagonal(rr)).where(torch.diagonal(rr) != 0, torch.ones(())), v.index_select(
        dim, order
    )


def dense_soap(p0, grads, *, lr, betas, shampoo_beta, eps, wd, freq, B, normalize, correct_bias, dtype=torch.float64):
    """SOAP on one matrix (or vector) in ``dtype``, from the update equations of Vyas et al. 2024 (Algorithm 3 with
    the eigenbasis refresh of Algorithm 4): step 1 only accumulates L = (1-sb) G G^T, R = (1-sb) G^T G and takes
    their eigenvectors; from then on, with t counting the updates:
    G' = QL^T G QR, M = b1 M + (1-b1) G, M' = QL^T M QR, V' = b2 V' + (1-b2) G'^2,
    N = QL (M' / (sqrt(V') + eps)) QR^T, p = (p - lr sqrt(1-b2^t)/(1-b1^t) N)(1 - lr wd), then L, R take G, and
    every ``freq`` updates each Q is refreshed. A dim larger than B is not rotated (Q = I); a vector is Adam."""
    p = p0.to(dtype).clone()
    b1, b2 = betas
    sb = b2 if shampoo_beta is None else shampoo_beta
    sides = [] if p.dim() < 2 else [d for d in (0, 1) if p.shape[d] <= B]
    factors = {d: torch.zeros(p.shape[d], p.shape[d], dtype=dtype) for d in sides}
    bases: dict[int, torch.Tensor] = {}

    def outer(g, d):
        return g @ g.T if d == 0 else g.T @ g

    def rot(x):  # QL^T x QR
        if 0 in bases:
            x = bases[0].T @ x
        return x @ bases[1] if 1 in bases else x

    def back(x):  # QL x QR^T
        if 0 in bases:
            x = bases[0] @ x
        return x @ bases[1].T if 1 in bases else x

    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    for i, g in enumerate(grads):
        g = g.to(dtype)
        if i == 0:
            for d in sides:
                factors[d] = (1 - sb) * outer(g, d)
                bases[d] = _descending_eigenvectors(factors[d])
            continue
        t = i
        gr = rot(g)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * gr * gr
        n = back(rot(m) / (v.sqrt() + eps))
        if normalize:
            n = n / (1e-30 + (n * n).mean().sqrt())
        size = lr * math.sqrt(1 - b2**t) / (1 - b1**t) if correct_bias else lr
        p = (p - size * n) * (1 - lr * wd)
        for d in sides:
            factors[d] = sb * factors[d] + (1 - sb) * outer(g, d)
        if t % freq == 0:
            for d in sides:
                bases[d], v = _power_qr(factors[d], bases[d], v, d)
    return p


# A band's first statistics are rank-deficient when it is not square (G G^T of an r x c band has rank min(r, c)), and
# the eigenbasis of a degenerate eigenspace is arbitrary: two correct implementations agree only for bands whose
# factors are full rank, square bands (c = r <= B) and bands whose columns are not rotated (c > B >= r).
band_st = st.tuples(st.integers(1, 6), st.booleans(), st.integers(1, 6))  # (rows, square?, extra columns)


def _case(rows, square, extra):
    return (rows, rows, rows) if square else (rows, rows + extra, rows)  # (band rows, cols, B)


@settings(max_examples=14, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    band=band_st,
    bands=st.integers(1, 3),
    freq=st.sampled_from([1, 2, 3, 10]),
    shampoo_beta=st.sampled_from([None, 0.8]),
    normalize=st.booleans(),
    correct_bias=st.booleans(),
    seed=st.integers(0, 999),
)
def test_matches_dense_fp64_reference(band, bands, freq, shampoo_beta, normalize, correct_bias, seed):
    """10 steps of ro.SOAP on float64 params (a matrix of 1-3 bands, a 3-D param, a vector) against the dense
    reference run on each band: <= 1e-6 relative on the updates. (Checked to fail on a SOAP that does not permute
    exp_avg_sq with the refreshed basis, does not sort the basis, skips the bias correction, decays the weights
    before the update, or uses another EMA factor for L.)"""
    r, c, B = _case(*band)
    gen = torch.Generator().manual_seed(seed)
    shapes = [(r * bands, c), (r, 1, c), (5,)]
    p0 = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(10)]
    kw = dict(lr=0.01, betas=(0.9, 0.95), shampoo_beta=shampoo_beta, eps=1e-8, weight_decay=0.1)
    ps = [x.clone().requires_grad_() for x in p0]
    opt = SOAP(
        ps, precondition_frequency=freq, max_preconditioner_dim=B, normalize_grads=normalize,
        correct_bias=correct_bias, **kw,
    )  # fmt: skip
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
    ref_kw = dict(lr=0.01, betas=(0.9, 0.95), shampoo_beta=shampoo_beta, eps=1e-8, wd=0.1, freq=freq, B=B)
    ref_kw.update(normalize=normalize, correct_bias=correct_bias)
    for k, (p, x) in enumerate(zip(ps, p0)):
        view = x.reshape(x.shape[0], -1) if x.dim() >= 2 else x
        gviews = [gs[k].reshape(view.shape) for gs in grads]
        rows = r if x.dim() >= 2 else view.shape[0]
        want = torch.cat(
            [
                dense_soap(view[s : s + rows], [g[s : s + rows] for g in gviews], **ref_kw)
                for s in range(0, view.shape[0], rows)
            ]
        )
        got = p.detach().reshape(want.shape)
        assert rel(got - view, want - view) <= 1e-6, (shapes[k], rel(got - view, want - view))


def test_float32_within_float32_rounding_of_the_reference():
    """float32 params: our distance to the float64 reference is of the order of the reference's own float32 run's
    distance to it (measured here), over 10 steps with basis refreshes."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 6, generator=gen)
    grads = [torch.randn(6, 6, generator=gen) for _ in range(10)]
    kw = dict(lr=0.01, betas=(0.95, 0.95), shampoo_beta=None, eps=1e-8, wd=0.01, freq=3, B=8)
    kw.update(normalize=False, correct_bias=True)
    want = dense_soap(x, grads, **kw)
    ref32 = dense_soap(x, grads, dtype=torch.float32, **kw)
    p = x.clone().requires_grad_()
    opt = SOAP([p], lr=0.01, precondition_frequency=3, max_preconditioner_dim=8)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    assert p.dtype == torch.float32
    x64 = x.double()
    assert_within_reference(rel(p.detach() - x64, want - x64), rel(ref32 - x64, want - x64), 1.0, "float32 SOAP")


@pytest.mark.parametrize("shape,B", [((10, 7), 4), ((3, 4, 5), 2), ((9, 1), 2), ((1, 9), 4), ((5, 3), 8)])
def test_bands_are_independent_soaps(shape, B):
    """Each band of B rows of the [d0, prod(rest)] view is a SOAP of its own (same op sequence: bitwise)."""
    gen = torch.Generator().manual_seed(2)
    p0 = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(5)]
    kw = dict(lr=0.05, precondition_frequency=2, max_preconditioner_dim=B)
    p = p0.clone().requires_grad_()
    opt = SOAP([p], **kw)
    view = p0.reshape(shape[0], -1)
    bands = [view[r : r + B].clone().requires_grad_() for r in range(0, shape[0], B)]
    opt_bands = SOAP(bands, **kw)
    for g in grads:
        p.grad = g.clone()
        for k, b in enumerate(bands):
            b.grad = g.reshape(shape[0], -1)[k * B : (k + 1) * B].clone()
        opt.step()
        opt_bands.step()
    assert torch.equal(p.detach().reshape(shape[0], -1), torch.cat([b.detach() for b in bands]))
    assert sorted(opt.state[p]["bands"]) == list(range(len(bands)))


def test_first_step_only_accumulates_statistics():
    """The first step leaves params and moments alone (as the reference implementation); the second moves them."""
    gen = torch.Generator().manual_seed(3)
    ps = [torch.randn(4, 6, generator=gen, requires_grad=True), torch.randn(6, generator=gen, requires_grad=True)]
    before = [p.detach().clone() for p in ps]
    opt = SOAP(ps, weight_decay=0.5)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ps, before))
    band = opt.state[ps[0]]["bands"][0]
    assert set(band) == {"L", "R", "Q_L", "Q_R", "exp_avg", "exp_avg_sq", "step"} and float(band["step"]) == 1
    assert not band["exp_avg"].any() and not band["exp_avg_sq"].any() and band["L"].any()
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(ps, before))


def test_columns_above_the_limit_are_not_rotated():
    """cols > max_preconditioner_dim: no right factor (Q_R = I), as the reference leaves large dims alone."""
    p = torch.randn(3, 12, requires_grad=True)
    opt = SOAP([p], max_preconditioner_dim=4)
    p.grad = torch.randn(3, 12)
    opt.step()
    assert set(opt.state[p]["bands"][0]) == {"L", "Q_L", "exp_avg", "exp_avg_sq", "step"}


def test_vector_params_are_adam_from_the_second_step():
    """A 1-D param is Adam (torch.optim.Adam as the control) on the gradients after its first (skipped) step; only
    where eps enters differs (added to sqrt(V) before the bias correction, as the reference)."""
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(7, generator=gen) for _ in range(6)]
    p = torch.zeros(7, dtype=torch.float64, requires_grad=True)
    q = torch.zeros(7, dtype=torch.float64, requires_grad=True)
    opt = SOAP([p], lr=0.1, weight_decay=0.0, eps=1e-12)
    adam = torch.optim.Adam([q], lr=0.1, betas=(0.95, 0.95), eps=1e-12)
    for i, g in enumerate(grads):
        p.grad = g.double()
        opt.step()
        if i:
            q.grad = g.double()
            adam.step()
    assert rel(p.detach(), q.detach()) <= 1e-9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_and_rank_one_grads_stay_finite(dtype):
    params = [
        torch.randn(8, 5, dtype=dtype, requires_grad=True),
        torch.randn(5, dtype=dtype, requires_grad=True),
        torch.randn((), dtype=dtype, requires_grad=True),
    ]
    opt = SOAP(params, max_preconditioner_dim=4, precondition_frequency=1)
    for step in range(5):
        for p in params:
            p.grad = torch.zeros_like(p) if step < 2 else torch.ones_like(p)
        opt.step()
        assert all(torch.isfinite(p).all() for p in params)
    band = opt.state[params[0]]["bands"][0]
    assert band["L"].dtype == torch.float32 and all(torch.isfinite(t).all() for t in band.values())


def test_eigh_failure_retries_in_float64_then_keeps_identity(monkeypatch):
    real = torch.linalg.eigh
    calls = []

    def flaky(x, *a, **k):
        calls.append(x.dtype)
        if x.dtype == torch.float32 or fail_all:
            raise torch.linalg.LinAlgError("simulated")
        return real(x, *a, **k)

    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    fail_all = False
    p = torch.randn(3, 3, requires_grad=True)
    opt = SOAP([p])
    p.grad = torch.randn(3, 3)
    opt.step()
    assert calls[:2] == [torch.float32, torch.float64]
    q = opt.state[p]["bands"][0]["Q_L"]
    assert q.dtype == torch.float32 and torch.allclose(q.T @ q, torch.eye(3), atol=1e-6)
    fail_all = True
    p2 = torch.randn(3, 3, requires_grad=True)
    opt2 = SOAP([p2])
    p2.grad = torch.randn(3, 3)
    opt2.step()
    assert torch.equal(opt2.state[p2]["bands"][0]["Q_L"], torch.eye(3))


def test_groups_with_their_own_band_height_and_a_tensor_lr():
    """max_preconditioner_dim per group gives each param its group's bands; a tensor lr steps as the float."""
    gen = torch.Generator().manual_seed(6)
    a, b = torch.randn(6, 3, generator=gen), torch.randn(6, 3, generator=gen)
    runs = []
    for lr in (0.01, torch.tensor(0.01, dtype=torch.float64)):
        ps = [a.clone().requires_grad_(), b.clone().requires_grad_()]
        opt = SOAP([{"params": [ps[0]], "max_preconditioner_dim": 2}, {"params": [ps[1]]}], lr=lr)
        for step in range(3):
            for p in ps:
                p.grad = torch.randn(6, 3, generator=torch.Generator().manual_seed(step))
            opt.step()
        assert sorted(opt.state[ps[0]]["bands"]) == [0, 1, 2] and sorted(opt.state[ps[1]]["bands"]) == [0]
        assert "R" not in opt.state[ps[0]]["bands"][0] and "R" in opt.state[ps[1]]["bands"][0]  # 3 cols > 2
        runs.append([p.detach().clone() for p in ps])
    assert all(torch.equal(x, y) for x, y in zip(*runs))


def test_nonfinite_grad_skips_the_step_and_changes_no_state():
    p = torch.randn(4, 5, requires_grad=True)
    opt = SOAP([p], precondition_frequency=1)
    for _ in range(2):
        p.grad = torch.randn(4, 5)
        opt.step()
    before = copy.deepcopy(opt.state_dict()), p.detach().clone()
    p.grad = torch.full((4, 5), float("nan"))
    with pytest.warns(RuntimeWarning, match="non-finite"):
        opt.step()
    after = opt.state_dict()
    assert torch.equal(p, before[1]) and after["state"][0]["step"] == before[0]["state"][0]["step"]
    assert all(torch.equal(t, before[0]["state"][0]["bands"][0][k]) for k, t in after["state"][0]["bands"][0].items())


# ----------------------------------------------------------------------------------------------- errors


def test_bad_params_name_the_param_and_the_fix():
    with pytest.raises(ValueError, match=r"params'\]\[1\].*no elements.*Leave it out"):
        SOAP([torch.randn(3, 3, requires_grad=True), torch.zeros(0, 4, requires_grad=True)])
    with pytest.raises(ValueError, match=r"complex.*view_as_real"):
        SOAP([torch.randn(3, 3, dtype=torch.complex64, requires_grad=True)])
    with pytest.raises(ValueError, match=r"dtype torch.int64.*floating"):
        SOAP([torch.ones(3, 3, dtype=torch.int64)])
    with pytest.raises(TypeError, match="ordered collection"):
        SOAP([{"params": {torch.randn(2, 2, requires_grad=True)}}])
    p = torch.randn(4, 4, requires_grad=True)
    opt = SOAP([{"params": [p], "param_names": ["emb.weight"]}])
    p.grad = torch.eye(4).to_sparse()
    with pytest.raises(ValueError, match=r"'emb.weight'.*sparse gradient.*sparse=False"):
        opt.step()


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(betas=(1.0, 0.95)), ValueError, "betas"),
        (dict(betas=(0.9,)), TypeError, "betas"),
        (dict(shampoo_beta=-1), ValueError, "shampoo_beta.*None"),
        (dict(eps=0.0), ValueError, "eps must be > 0"),
        (dict(weight_decay=-0.1), ValueError, "weight_decay"),
        (dict(lr=-1.0), ValueError, "lr"),
        (dict(lr="0.1"), TypeError, "lr"),
        (dict(max_preconditioner_dim=0), ValueError, "max_preconditioner_dim"),
        (dict(precondition_frequency=2.5), ValueError, "precondition_frequency"),
        (dict(normalize_grads="no"), TypeError, "normalize_grads"),
        (dict(correct_bias=1), TypeError, "correct_bias"),
    ],
)
def test_bad_options(kw, exc, match):
    with pytest.raises(exc, match=match):
        SOAP([torch.randn(3, 3, requires_grad=True)], **kw)


# ----------------------------------------------------------------------------------------------- state dicts


def _two_opts(B=4):
    gen = torch.Generator().manual_seed(5)
    ps = [torch.randn(9, 6, generator=gen, requires_grad=True), torch.randn(6, generator=gen, requires_grad=True)]
    qs = [p.detach().clone().requires_grad_() for p in ps]
    return ps, qs, SOAP(ps, max_preconditioner_dim=B, precondition_frequency=2), gen


def test_state_dict_round_trip():
    ps, qs, a, gen = _two_opts()
    b = SOAP(qs, max_preconditioner_dim=4, precondition_frequency=2)
    grads = [[torch.randn(p.shape, generator=gen) for p in ps] for _ in range(6)]
    for gs in grads[:3]:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        a.step()
    for q, p in zip(qs, ps):
        q.data.copy_(p.detach())
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    for gs in grads[3:]:
        for p, q, g in zip(ps, qs, gs):
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, qs))


def test_load_state_dict_refuses_bands_of_another_layout():
    """A state dict saved with another max_preconditioner_dim has bands of other shapes: refused, nothing changed."""
    ps, qs, a, gen = _two_opts(B=4)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    a.step()
    b = SOAP(qs, max_preconditioner_dim=3)
    sd = copy.deepcopy(a.state_dict())
    sd["param_groups"][0]["max_preconditioner_dim"] = 3  # the hyperparameter alone would hide the mismatch
    with pytest.raises(ValueError, match=r"band 0.*'L'.*shape.*max_preconditioner_dim"):
        b.load_state_dict(sd)
    assert not b.state
    no_step = copy.deepcopy(a.state_dict())
    del no_step["state"][0]["step"]
    with pytest.raises(ValueError, match="lacks"):
        SOAP(qs, max_preconditioner_dim=4).load_state_dict(no_step)


def test_exported_from_the_package():
    assert ro.SOAP is SOAP
    assert "SOAP" in ro.__all__
