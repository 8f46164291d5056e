"""Quintic Newton-Schulz orthogonalization (the matrix step of Muon).

Given a matrix G = U S V^T, the iteration drives every singular value towards ~1 and returns approximately U V^T
(the coefficients maximise the slope at zero, so singular values land in roughly [0.7, 1.2] rather than exactly 1).

With ``matmul="native"`` the numerics follow ``torch.optim.Muon`` exactly for 2-D input in bf16: cast to the
compute dtype, transpose when the matrix has more rows than columns (so the Gram matrix is the smaller side), divide
by the Frobenius norm clamped below by ``eps``, then ``steps`` times::

    A = X @ X^T
    B = b * A + c * (A @ A)      # torch.addmm(A, A, A, beta=b, alpha=c)
    X = a * X + B @ X            # torch.addmm(X, B, X, beta=a)

and transpose back. Inputs with leading dims ``[..., m, n]`` are a batch of independent matrices; each result equals
orthogonalizing that matrix alone, bit for bit (by default the batch runs the 2-D op sequence per matrix; the
``batched_matmul=True`` option trades that guarantee for ``torch.baddbmm``). tests/test_muon_plain.py checks both.

How the matmuls run (``matmul``): ``"native"`` calls them in the compute dtype, as torch.optim.Muon does.
``"upcast"`` keeps every operand and result rounded to the compute dtype but runs each matmul in float32 and rounds
its output once: bf16 storage with fp32 accumulation, which is what a bf16 GEMM does on tensor cores and on CPUs
that have one. It differs from ``"native"`` only in the fp32 summation order inside a matmul (on CPU, torch 2.13:
``addmm`` bitwise equal, the Gram matrix 1 ulp apart in ~0.02% of elements). Five iterations amplify such flips,
as they would between any two bf16 GEMM backends: the two results are 1-2% of the largest entry apart, and each is
as far from the fp32 result as the other (tests/test_newton_schulz_matmul.py measures both). ``"auto"`` (the
default) picks ``"upcast"`` for bf16/fp16 on a CPU without a native low-precision GEMM (torch's bf16 matmul there is
a generic loop, 10-70x slower than fp32 per op), ``"native"`` everywhere else.

No Triton kernel here: the work is three matmuls per step, which cuBLAS / oneDNN already do well; this module is
the reference and the production path alike.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "DEFAULT_NS_STEPS",
    "DEFAULT_NS_EPS",
    "NS_MATMUL_MODES",
    "newton_schulz",
    "resolve_ns_matmul",
]

_CASTS = {torch.bfloat16: Tensor.bfloat16, torch.float16: Tensor.half, torch.float32: Tensor.float}
DEFAULT_NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
DEFAULT_NS_EPS = 1e-7
NS_MATMUL_MODES = ("auto", "native", "upcast")


def resolve_ns_matmul(matmul: str, dtype: torch.dtype, device: torch.device | str) -> str:
    """``"native"`` or ``"upcast"`` for ``matmul`` in :data:`NS_MATMUL_MODES`; ``"auto"`` picks ``"upcast"`` only for
    bf16/fp16 compute on a CPU whose oneDNN has no native kernel for that dtype."""
    if matmul not in NS_MATMUL_MODES:
        raise ValueError(f"matmul must be one of {NS_MATMUL_MODES}, got {matmul!r}")
    if matmul != "auto":
        return matmul
    if torch.device(device).type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return "native"
    return "native" if _cpu_has_lowp_gemm(dtype) else "upcast"


@functools.cache  # asked on every newton_schulz call; the answer is fixed for the process
def _cpu_has_lowp_gemm(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    name = "_is_mkldnn_bf16_supported" if dtype == torch.bfloat16 else "_is_mkldnn_fp16_supported"
    try:
        return bool(getattr(torch.ops.mkldnn, name)())
    except (AttributeError, RuntimeError):  # an older or stripped build: assume no native kernel
        return False


def newton_schulz(
    G: Tensor,
    steps: int = DEFAULT_NS_STEPS,
    coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    eps: float = DEFAULT_NS_EPS,
    dtype: torch.dtype = torch.bfloat16,
    batched_matmul: bool = False,
    matmul: str = "auto",
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """Orthogonalize ``G`` (shape ``[..., m, n]``) with ``steps`` quintic Newton-Schulz iterations.

    Args:
        G: a real floating tensor with at least 2 dims; leading dims are a batch of independent matrices.
        steps: number of iterations (0 returns the normalised input).
        coefficients: ``(a, b, c)`` of the polynomial ``a X + b (X X^T) X + c (X X^T)^2 X``.
        eps: lower clamp of the Frobenius norm used to normalise each matrix.
        dtype: the compute dtype (``torch.bfloat16`` like torch.optim.Muon, or ``torch.float32``).
        batched_matmul: for ``[..., m, n]`` input, run the batch through ``torch.baddbmm`` (fewer kernel launches
            for many small matrices) instead of one matrix at a time. Off by default: batched matmul kernels are
            not bitwise equal to the 2-D ones everywhere (on CPU, in our tests, they matched in bf16
            but not in fp32), and the
            default keeps ``newton_schulz(G)[i] == newton_schulz(G[i])`` bit for bit on every backend.
        matmul: ``"auto"``, ``"native"`` (torch.optim.Muon's ops, bitwise) or ``"upcast"`` (operands rounded to
            ``dtype``, each matmul in float32; bf16 and fp16 only, fp32/fp64 compute is left alone); see the module
            docstring.
        out_dtype: the result's dtype (default ``G``'s). ``dtype`` skips the final cast: a caller that adds the
            result to an fp32 tensor (``p.add_(o, alpha=...)``, as torch.optim.Muon does) gets the same bits.

    Returns:
        A new tensor with ``G``'s shape and ``out_dtype`` (``G`` is never modified).
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix or a batch of matrices [..., m, n], got shape {tuple(G.shape)}")
    if G.is_complex() or not G.is_floating_point():
        raise ValueError(f"newton_schulz needs a real floating tensor, got dtype {G.dtype}")
    if len(coefficients) != 3:
        raise ValueError(f"coefficients must be (a, b, c), got {coefficients!r}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    a, b, c = coefficients
    out_dtype = G.dtype if out_dtype is None else out_dtype
    m, n = G.shape[-2], G.shape[-1]
    if G.numel() == 0:
        return torch.zeros_like(G, dtype=out_dtype)
    transpose = m > n
    # fp32 and fp64 compute have nothing to upcast to: "upcast" only changes bf16 and fp16.
    upcast = resolve_ns_matmul(matmul, dtype, G.device) == "upcast" and dtype in (torch.bfloat16, torch.float16)
    # r(t) rounds a result to the compute dtype; under "upcast" the math runs in float32 on already-rounded values.
    compute = torch.float32 if upcast else dtype
    r = (lambda t: t.to(dtype).to(compute)) if upcast else (lambda t: t)

    if G.ndim == 2:
        X = _ns_matrix(G, steps, a, b, c, eps, dtype, compute, r, transpose)
        return X if X.dtype == out_dtype else X.to(out_dtype)

    batch_shape = G.shape[:-2]
    flat = G.reshape(-1, m, n)
    if not batched_matmul:
        out = torch.stack([_ns_matrix(x, steps, a, b, c, eps, dtype, compute, r, transpose) for x in flat])
        return out.reshape(*batch_shape, m, n).to(out_dtype)
    X = flat.to(dtype, copy=True).to(compute)
    if transpose:
        X = X.mT
    norms = r(torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True))
    X = r(X / r(norms.clamp(min=eps)))
    for _ in range(steps):
        A = r(X @ X.mT)
        B = r(torch.baddbmm(A, A, A, beta=b, alpha=c))
        X = r(torch.baddbmm(X, B, X, beta=a))
    if transpose:
        X = X.mT
    return X.to(dtype).reshape(*batch_shape, m, n).to(out_dtype)


def _ns_matrix(G: Tensor, steps: int, a: float, b: float, c: float, eps: float, dtype, compute, r, transpose: bool):
    """One 2-D matrix, torch.optim.Muon's sequence of ops (whole-tensor norm, addmm) run in ``compute`` with every
    result rounded by ``r`` (identity when ``compute == dtype``: exactly torch's ops); returns ``dtype``."""
    if compute == dtype:
        return _ns_matrix_native(G, steps, a, b, c, eps, dtype, transpose)
    X = G.to(dtype, copy=True).to(compute)
    if transpose:
        X = X.T
    X = r(X / r(r(X.norm()).clamp(min=eps)))  # the same rounding points as the in-dtype ops
    for _ in range(steps):
        A = r(X @ X.T)
        B = r(torch.addmm(A, A, A, beta=b, alpha=c))
        X = r(torch.addmm(X, B, X, beta=a))
    if transpose:
        X = X.T
    return X.to(dtype)


def _ns_matrix_native(G: Tensor, steps: int, a: float, b: float, c: float, eps: float, dtype, transpose: bool):
    """:func:`_ns_matrix` in ``dtype`` itself: torch.optim.Muon's ops and nothing else (no rounding calls, no
    casts), since on a GPU a small matrix's Newton-Schulz is bound by the host's per-op cost."""
    # A copy either way. Tensor.bfloat16() & co. cost the host less than .to(dtype) (measured: ~3% of a small
    # matrix's Newton-Schulz on CPU, where the host's per-op cost is what a GPU step waits on).
    cast = _CASTS.get(dtype) if G.dtype != dtype else None
    X = cast(G) if cast is not None else G.to(dtype, copy=True)
    if transpose:
        X = X.T
    X.div_(X.norm().clamp(min=eps))
    for _ in range(steps):
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a)
    return X.T if transpose else X
