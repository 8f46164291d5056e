"""Newton-Schulz ``matmul="upcast"`` (bf16 operands, fp32 matmuls) against ``"native"`` (torch.optim.Muon's ops):
the same rounding points, the same accuracy, and the ``"auto"`` rule."""

from __future__ import annotations

import pytest
import torch
from noise_bounds import FACTOR, ULPS, assert_within_reference
from ns_reference import COEFFS, displacement_gap, ns_noise, torch_muon_ns_in

from ragged_optim.kernels.newton_schulz import _cpu_has_lowp_gemm, newton_schulz, resolve_ns_matmul
from ragged_optim.optim import Muon

SHAPES = [(24, 8), (8, 24), (1, 50), (50, 1), (64, 128), (128, 64), (200, 200), (256, 512)]


def randn(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def rel_diff(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def test_auto_rule():
    assert resolve_ns_matmul("auto", torch.float32, "cpu") == "native"
    assert resolve_ns_matmul("auto", torch.bfloat16, "meta") == "native"  # not a CPU: the device's own GEMM
    expected = "native" if _cpu_has_lowp_gemm(torch.bfloat16) else "upcast"
    assert resolve_ns_matmul("auto", torch.bfloat16, "cpu") == expected
    assert resolve_ns_matmul("native", torch.bfloat16, "cpu") == "native"
    with pytest.raises(ValueError, match="matmul must be one of"):
        newton_schulz(randn((4, 4)), matmul="fast")
    with pytest.raises(ValueError, match="ns_matmul must be one of"):
        Muon([randn((4, 4)).requires_grad_()], ns_matmul="fp32")


def correctly_rounded_iteration(X: torch.Tensor) -> torch.Tensor:
    """One NS iteration from the bf16 values ``X`` with every matmul in float64, rounded to bf16 where torch's ops
    round (after X X^T, after b A + c A A, after a X + B X): what an fp32-accumulating bf16 matmul gives except
    where its summation error crosses a bf16 rounding boundary."""
    a, b, c = COEFFS
    tall = X.size(0) > X.size(1)
    X = (X.T if tall else X).double()

    def r(t):
        return t.bfloat16().double()

    A = r(X @ X.T)
    B = r(b * A + c * (A @ A))
    X = r(a * X + B @ X)
    return (X.T if tall else X).float()


def fp32_iteration(X: torch.Tensor, parts: int) -> torch.Tensor:
    """One iteration with the correct rounding points and fp32 matmuls summed over ``parts`` slices of the inner
    dim: another fp32 summation order for each ``parts``."""
    a, b, c = COEFFS
    tall = X.size(0) > X.size(1)
    X = (X.T if tall else X).float()

    def mm(P, Q):
        out = None
        for k in torch.tensor_split(torch.arange(P.shape[1]), parts):
            if len(k):
                out = P[:, k] @ Q[k] if out is None else out + P[:, k] @ Q[k]
        return out

    def r(t):
        return t.bfloat16().float()

    A = r(mm(X, X.T))
    B = r(b * A + c * mm(A, A))
    X = r(a * X + mm(B, X))
    return X.T if tall else X


def fp32_order_noise(X: torch.Tensor) -> int:
    """How many elements legitimate fp32 summation orders disagree on after one iteration from ``X``: a flip near a
    bf16 boundary in the Gram matrix spreads through the next two matmuls (measured on an AMX Xeon: 21 of 40,000 at
    200x200 for a plain fp32 order against a split one, where torch's native bf16 ops flipped 1)."""
    outs = [fp32_iteration(X, parts) for parts in (1, 2, 3, 4)]
    return max(int((x != y).sum()) for x in outs for y in outs)


@pytest.mark.parametrize("shape", SHAPES)
def test_upcast_rounds_where_native_does(shape):
    """Normalisation is bitwise equal. Each iteration, both round an fp32-accumulated matmul to bf16 at the same
    points, so each differs from the correctly rounded iteration (float64 matmuls) only where fp32's summation
    order crosses a bf16 rounding boundary: rare single-ulp flips, whose count depends on the CPU's GEMM and which
    spread through the iteration's later matmuls. Upcast flips no more often than torch's native ops or other fp32
    summation orders in the same run (FACTOR x the larger count + ULPS elements; an extra rounding point would flip
    thousands), and the two differ by one bf16 ulp at most after one iteration."""
    G = randn(shape, seed=1)
    X = newton_schulz(G, steps=0, matmul="native")
    assert torch.equal(newton_schulz(G, steps=0, matmul="upcast"), X)
    for steps in (1, 2):
        # the same input for both: the previous iteration's (bf16) result of each
        prev_up, prev_nat = (newton_schulz(G, steps=steps - 1, matmul=m) for m in ("upcast", "native"))
        up, nat = newton_schulz(G, steps=steps, matmul="upcast"), newton_schulz(G, steps=steps, matmul="native")
        flips_up = int((up != correctly_rounded_iteration(prev_up)).sum())
        flips_nat = int((nat != correctly_rounded_iteration(prev_nat)).sum())
        noise = fp32_order_noise(prev_up)
        assert flips_up <= FACTOR * max(flips_nat, noise) + ULPS, (steps, flips_up, flips_nat, noise)
        if steps == 1:
            assert ((up - nat).abs() <= 2**-7 * torch.maximum(up.abs(), nat.abs())).all()  # one bf16 ulp at most
    out = newton_schulz(G, matmul="upcast")
    assert out.dtype == G.dtype and torch.equal(out, out.bfloat16().float())  # results are bf16 values


def test_upcast_as_accurate_as_native(capsys):
    """Against fp32 Newton-Schulz, the upcast result is no further off than torch's bf16 ops: within FACTOR x
    their distance measured in the same run (measured on this CPU: 1.3e-2 .. 2.0e-2 of the largest entry for both,
    upcast never further than native)."""
    rows = []
    for shape in [(256, 128), (512, 512), (1024, 256), (64, 64)]:
        for seed in range(2):
            G = randn(shape, seed)
            ref = newton_schulz(G, dtype=torch.float32)
            up = rel_diff(newton_schulz(G, matmul="upcast"), ref)
            nat = rel_diff(newton_schulz(G, matmul="native"), ref)
            rows.append((shape, up, nat))
            assert_within_reference(up, nat, 1.0, f"upcast NS vs fp32, {shape} seed {seed}")
    with capsys.disabled():
        print("\n[NS upcast vs native, each vs fp32] " + ", ".join(f"{s}: {u:.3g}/{n:.3g}" for s, u, n in rows))


def test_upcast_leaves_fp32_and_fp64_compute_alone():
    G = randn((20, 12), seed=3).double()
    for dtype in (torch.float32, torch.float64):
        assert torch.equal(
            newton_schulz(G, dtype=dtype, matmul="upcast"), newton_schulz(G, dtype=dtype, matmul="native")
        )


def test_upcast_batched_equals_per_matrix():
    """Per matrix by default: bitwise. baddbmm sums in another order: within FACTOR x the distance torch's own bf16
    NS has from float64 on the same matrices, measured here (tests/support/ns_reference.py)."""
    G = randn((3, 40, 24), seed=2)
    each = torch.stack([newton_schulz(x, matmul="upcast") for x in G])
    assert torch.equal(newton_schulz(G, matmul="upcast"), each)
    batched = newton_schulz(G, matmul="upcast", batched_matmul=True)
    assert_within_reference(rel_diff(batched, each), ns_noise(list(G), torch.bfloat16), 1.0, "batched upcast NS")


def test_muon_upcast_tracks_torch_muon():
    """Ten Muon steps with upcast Newton-Schulz stay within bf16 rounding noise of torch.optim.Muon: FACTOR x the
    distance torch's own bf16 Muon has from the same Muon with float64 Newton-Schulz, same grads, same run (both
    relative to how far the params moved)."""
    shapes = [(24, 8), (8, 24), (64, 32), (1, 12)]
    ps = [randn(s, i).requires_grad_() for i, s in enumerate(shapes)]
    qs, xs = ([p.detach().clone().requires_grad_() for p in ps] for _ in range(2))
    p0 = [p.detach().clone() for p in ps]
    ours = Muon(ps, weight_decay=0.01, ns_matmul="upcast")
    ref = torch.optim.Muon(qs, lr=0.02, weight_decay=0.01)
    exact = torch.optim.Muon(xs, lr=0.02, weight_decay=0.01)
    gen = torch.Generator().manual_seed(5)
    for _ in range(10):
        for p, q, x in zip(ps, qs, xs):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad, x.grad = p.grad.clone(), p.grad.clone()
        ours.step()
        ref.step()
        with torch_muon_ns_in(torch.float64):
            exact.step()
    noise = displacement_gap(qs, xs, p0)
    assert_within_reference(displacement_gap(ps, qs, p0), noise, 1.0, "upcast Muon vs torch.optim.Muon")
