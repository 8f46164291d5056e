"""Rounding-noise references for Newton-Schulz comparisons, measured in the same run (imported by tests).

Two Newton-Schulz results in the same low precision (bf16 native vs upcast matmuls, batched vs per-matrix, ours vs
torch.optim.Muon's) cannot be bit for bit equal on every CPU: they round at the same points but sum in another
order, and NS amplifies each rounding over its iterations. How far depends on the CPU's GEMM (ATen's default or
AVX2 kernels, a bf16 unit, oneDNN) and thread count, so the allowed gap is not a constant: it is FACTOR times the
distance an independent computation in the same precision has from the exact result, measured here on the same
inputs (tests/support/noise_bounds.py). The independent computation is torch.optim.Muon's own bf16 iteration where the
precision is bf16, and the iteration written out below where it is another dtype (torch's runs only in bf16); the
exact result is the same iteration in float64. A real bug (a wrong coefficient, a transposed or mixed-up matrix,
a missing step) moves the result by O(1) of its largest entry, far above the bf16 noise (~1e-2) and the fp32 one.
"""

from __future__ import annotations

import contextlib

import torch
import torch.optim._muon as torch_muon_module
from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

COEFFS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's defaults
STEPS = 5
EPS = 1e-7


def ns_in(G: torch.Tensor, dtype: torch.dtype, coeffs=COEFFS, steps: int = STEPS, eps: float = EPS) -> torch.Tensor:
    """torch.optim.Muon's quintic iteration on a 2-D ``G``, computed in ``dtype`` (written out here, independent of
    ragged_optim's implementation); returns ``dtype``."""
    a, b, c = coeffs
    X = G.to(dtype)
    tall = X.size(0) > X.size(1)
    if tall:
        X = X.T
    X = X / X.norm().clamp(min=eps)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|, in float64."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def displacement_gap(ps, qs, p0) -> float:
    """max over params of max|p - q| / max|q - p0|: a gap relative to how far the steps moved the params (relative
    to the params themselves, a wrong NS coefficient would hide under their magnitude)."""
    return max(((p - q).abs().max() / (q - x).abs().max()).item() for p, q, x in zip(ps, qs, p0))


def ns_noise(mats, dtype: torch.dtype) -> float:
    """The largest distance, relative to the largest entry, of an independent ``dtype`` Newton-Schulz from the
    float64 one over the 2-D matrices ``mats``: torch's own iteration for bf16, :func:`ns_in` otherwise."""
    out = 0.0
    for G in mats:
        low = torch_ns(G.clone(), COEFFS, STEPS, EPS) if dtype == torch.bfloat16 else ns_in(G, dtype)
        out = max(out, rel_diff(low, ns_in(G, torch.float64)))
    return out


@contextlib.contextmanager
def torch_muon_ns_in(dtype: torch.dtype):
    """Within the block, torch.optim.Muon orthogonalizes with :func:`ns_in` in ``dtype`` instead of its bf16
    iteration (its step looks the function up in its module each call): the same optimizer, another precision."""
    real = torch_muon_module._zeropower_via_newtonschulz

    def patched(grad, ns_coefficients, ns_steps, eps):
        return ns_in(grad, dtype, ns_coefficients, ns_steps, eps)

    torch_muon_module._zeropower_via_newtonschulz = patched
    try:
        yield
    finally:
        torch_muon_module._zeropower_via_newtonschulz = real
