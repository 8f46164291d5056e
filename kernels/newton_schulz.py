"""Quintic Newton-Schulz orthogonalization (the matrix step of Muon).

Given a matrix G = U S V^T, the iteration drives every singular value towards ~1 and returns approximately U V^T
(the coefficients maximise the slope at zero, so singular values land in roughly [0.7, 1.2] rather than exactly 1).

Numerics follow ``torch.optim.Muon`` exactly for 2-D input in bf16: cast to the compute dtype, transpose when the
matrix has more rows than columns (so the Gram matrix is the smaller side), divide by the Frobenius norm clamped
below by ``eps``, then ``steps`` times::

    A = X @ X^T
    B = b * A + c * (A @ A)      # torch.addmm(A, A, A, beta=b, alpha=c)
    X = a * X + B @ X            # torch.addmm(X, B, X, beta=a)

and transpose back. Inputs with leading dims ``[..., m, n]`` are a batch of independent matrices; each result equals
orthogonalizing that matrix alone, bit for bit (by default the batch runs the 2-D op sequence per matrix; the
``batched_matmul=True`` option trades that guarantee for ``torch.baddbmm``). tests/test_muon_plain.py checks both.

No Triton kernel here: the work is three matmuls per step, which cuBLAS / oneDNN already do well; this module is
the reference and the production path alike.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["DEFAULT_NS_COEFFICIENTS", "DEFAULT_NS_STEPS", "DEFAULT_NS_EPS", "newton_schulz"]

DEFAULT_NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
DEFAULT_NS_EPS = 1e-7


def newton_schulz(
    G: Tensor,
    steps: int = DEFAULT_NS_STEPS,
    coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    eps: float = DEFAULT_NS_EPS,
    dtype: torch.dtype = torch.bfloat16,
    batched_matmul: bool = False,
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

    Returns:
        A new tensor with ``G``'s shape and dtype (``G`` is never modified).
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
    out_dtype = G.dtype
    m, n = G.shape[-2], G.shape[-1]
    if G.numel() == 0:
        return torch.zeros_like(G)
    transpose = m > n

    if G.ndim == 2:
        return _ns_matrix(G, steps, a, b, c, eps, dtype, transpose).to(out_dtype)

    batch_shape = G.shape[:-2]
    flat = G.reshape(-1, m, n)
    if not batched_matmul:
        out = torch.stack([_ns_matrix(x, steps, a, b, c, eps, dtype, transpose) for x in flat])
        return out.reshape(*batch_shape, m, n).to(out_dtype)
    X = flat.to(dtype, copy=True)
    if transpose:
        X = X.mT
    norms = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    X.div_(norms.clamp(min=eps))
    for _ in range(steps):
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    if transpose:
        X = X.mT
    return X.reshape(*batch_shape, m, n).to(out_dtype)


def _ns_matrix(G: Tensor, steps: int, a: float, b: float, c: float, eps: float, dtype: torch.dtype, transpose: bool):
    """One 2-D matrix, exactly torch.optim.Muon's sequence of ops (whole-tensor norm, addmm); returns ``dtype``."""
    X = G.to(dtype, copy=True)
    if transpose:
        X = X.T
    X.div_(X.norm().clamp(min=eps))
    for _ in range(steps):
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a)
    if transpose:
        X = X.T
    return X
