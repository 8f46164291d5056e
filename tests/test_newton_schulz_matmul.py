"""Newton-Schulz ``matmul="upcast"`` (bf16 operands, fp32 matmuls) against ``"native"`` (torch.optim.Muon's ops):
the same rounding points, the same accuracy, and the ``"auto"`` rule."""

from __future__ import annotations

import pytest
import torch

from ragged_optim.kernels.newton_schulz import _cpu_has_lowp_gemm, newton_schulz, resolve_ns_matmul
from ragged_optim.optim import BF16_NS_REL_TOL, Muon

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


@pytest.mark.parametrize("shape", SHAPES)
def test_upcast_rounds_where_native_does(shape):
    """Normalisation is bitwise equal. After one iteration the only differences are single-ulp flips from the
    fp32 summation order inside a matmul (rare: none in most shapes); after two nearly every element still agrees."""
    G = randn(shape, seed=1)
    assert torch.equal(newton_schulz(G, steps=0, matmul="upcast"), newton_schulz(G, steps=0, matmul="native"))
    a, b = newton_schulz(G, steps=1, matmul="upcast"), newton_schulz(G, steps=1, matmul="native")
    assert (a == b).float().mean() >= 0.999
    assert ((a - b).abs() <= 2**-7 * torch.maximum(a.abs(), b.abs())).all()  # one bf16 ulp at most
    a, b = newton_schulz(G, steps=2, matmul="upcast"), newton_schulz(G, steps=2, matmul="native")
    assert (a == b).float().mean() >= 0.99
    out = newton_schulz(G, matmul="upcast")
    assert out.dtype == G.dtype and torch.equal(out, out.bfloat16().float())  # results are bf16 values


def test_upcast_as_accurate_as_native(capsys):
    """Against fp32 Newton-Schulz, the upcast result is no further off than torch's bf16 ops (measured here:
    1.3e-2 .. 2.0e-2 of the largest entry for both); the two bf16 results differ by about as much."""
    rows = []
    for shape in [(256, 128), (512, 512), (1024, 256), (64, 64)]:
        for seed in range(2):
            G = randn(shape, seed)
            ref = newton_schulz(G, dtype=torch.float32)
            up = rel_diff(newton_schulz(G, matmul="upcast"), ref)
            nat = rel_diff(newton_schulz(G, matmul="native"), ref)
            rows.append((shape, up, nat))
            assert up <= 1.25 * nat and up < BF16_NS_REL_TOL, (shape, seed, up, nat)
    with capsys.disabled():
        print("\n[NS upcast vs native, each vs fp32] " + ", ".join(f"{s}: {u:.3g}/{n:.3g}" for s, u, n in rows))


def test_upcast_leaves_fp32_and_fp64_compute_alone():
    G = randn((20, 12), seed=3).double()
    for dtype in (torch.float32, torch.float64):
        assert torch.equal(
            newton_schulz(G, dtype=dtype, matmul="upcast"), newton_schulz(G, dtype=dtype, matmul="native")
        )


def test_upcast_batched_equals_per_matrix():
    G = randn((3, 40, 24), seed=2)
    each = torch.stack([newton_schulz(x, matmul="upcast") for x in G])
    assert torch.equal(newton_schulz(G, matmul="upcast"), each)
    assert rel_diff(newton_schulz(G, matmul="upcast", batched_matmul=True), each) < BF16_NS_REL_TOL


def test_muon_upcast_tracks_torch_muon():
    """Ten Muon steps with upcast Newton-Schulz stay within the bf16 tolerance of torch.optim.Muon."""
    shapes = [(24, 8), (8, 24), (64, 32), (1, 12)]
    ps = [randn(s, i).requires_grad_() for i, s in enumerate(shapes)]
    qs = [p.detach().clone().requires_grad_() for p in ps]
    p0 = [p.detach().clone() for p in ps]
    ours = Muon(ps, weight_decay=0.01, ns_matmul="upcast")
    ref = torch.optim.Muon(qs, lr=0.02, weight_decay=0.01)
    gen = torch.Generator().manual_seed(5)
    for _ in range(10):
        for p, q in zip(ps, qs):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
    worst = max(((p - q).abs().max() / (q - x).abs().max()).item() for p, q, x in zip(ps, qs, p0))
    assert worst < BF16_NS_REL_TOL
