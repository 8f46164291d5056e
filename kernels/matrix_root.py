"""Inverse matrix roots ``(A + epsilon * I)^(-alpha)`` of symmetric positive semi-definite matrices (Shampoo).

Two methods, both taking a batch ``[..., n, n]`` and returning float32:

- ``"eigh"`` (default): ``A = Q diag(lam) Q^T`` by ``torch.linalg.eigh`` in float32, then
  ``Q diag((lam - min(lam_min, 0) + epsilon)^(-alpha)) Q^T``. The shift by a negative smallest eigenvalue
  (round-off in a rank-deficient statistic) keeps every eigenvalue >= epsilon, so the result is finite whenever
  ``epsilon > 0``. When eigh fails to converge or the result is not finite, the matrix is redone in float64.
- ``"newton"``: the coupled Newton iteration for the inverse p-th root (Guo and Higham, 2006), p = 1 / alpha
  (must be an integer). With ``A_e = A + epsilon * I`` and ``z = (p + 1) / (2 * ||A_e||_F)``::

      X_0 = z^(1/p) I,   M_0 = z A_e
      T_k = ((p + 1) I - M_k) / p,   X_{k+1} = X_k T_k,   M_{k+1} = T_k^p M_k

  The invariant ``M_k = X_k^p A_e`` holds at every step, so ``M_k -> I`` means ``X_k -> A_e^(-1/p)``. It stops
  when ``max|M_k - I| < tol`` or after ``max_iters`` (float32 throughout; matmuls only, no decomposition).
  Convergence is slow (about 1 iteration per factor 2.4 of condition number) when epsilon is tiny and the
  statistic is rank-deficient, so keep epsilon relatively larger with this method.

Pure torch, no distributed code: ``ragged_optim.optim.shampoo`` calls it per block.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["RootInverseError", "matrix_inverse_root", "eigh_inverse_root", "newton_inverse_root"]


class RootInverseError(RuntimeError):
    """Raised when no method produced a finite inverse root."""


def _check(a: Tensor) -> None:
    if a.ndim < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"need a square matrix or a batch [..., n, n], got shape {tuple(a.shape)}")


def _eigh_root(a: Tensor, alpha: float, epsilon: float, dtype: torch.dtype) -> Tensor:
    x = a.to(dtype)
    x = (x + x.mT) * 0.5  # exact symmetry: accumulated statistics drift by round-off
    lam, q = torch.linalg.eigh(x)
    shift = lam.amin(dim=-1, keepdim=True).clamp(max=0)
    lam = (lam - shift + epsilon).pow(-alpha)
    return (q * lam.unsqueeze(-2)) @ q.mT


def eigh_inverse_root(a: Tensor, alpha: float, epsilon: float) -> Tensor:
    """``(A + epsilon I)^(-alpha)`` by eigendecomposition in float32, redone in float64 when that fails."""
    _check(a)
    try:
        out = _eigh_root(a, alpha, epsilon, torch.float32)
        if bool(torch.isfinite(out).all()):
            return out
    except RuntimeError:  # torch.linalg.LinAlgError: eigh did not converge
        pass
    try:
        out = _eigh_root(a, alpha, epsilon, torch.float64).to(torch.float32)
    except RuntimeError as e:
        raise RootInverseError(f"eigh failed in float32 and float64 on a {tuple(a.shape)} statistic: {e}") from e
    if not bool(torch.isfinite(out).all()):
        raise RootInverseError(
            f"the inverse root of a {tuple(a.shape)} statistic is not finite even in float64 "
            f"(epsilon={epsilon}): raise epsilon"
        )
    return out


def newton_inverse_root(
    a: Tensor, alpha: float, epsilon: float, *, max_iters: int = 100, tol: float = 1e-6
) -> tuple[Tensor, int]:
    """``(A + epsilon I)^(-alpha)`` by the coupled Newton iteration (float32); returns (root, iterations used)."""
    _check(a)
    p_float = 1.0 / alpha
    p = round(p_float)
    if p < 1 or abs(p - p_float) > 1e-9:
        raise ValueError(f"the Newton method computes A^(-1/p) for an integer p >= 1; exponent {alpha} is not 1/p")
    n = a.shape[-1]
    eye = torch.eye(n, dtype=torch.float32, device=a.device).expand_as(a)
    ae = a.to(torch.float32) + epsilon * eye
    norm = torch.linalg.matrix_norm(ae, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    z = (p + 1) / (2 * norm)
    x = z.pow(1.0 / p) * eye
    m = z * ae
    iters = 0
    for iters in range(1, max_iters + 1):  # noqa: B007 (the count is returned)
        t = ((p + 1) * eye - m) / p
        x = x @ t
        m = torch.linalg.matrix_power(t, p) @ m
        if float((m - eye).abs().amax()) < tol:
            break
    if not bool(torch.isfinite(x).all()):
        raise RootInverseError(f"the Newton iteration diverged on a {tuple(a.shape)} statistic: raise epsilon")
    return x, iters


def matrix_inverse_root(a: Tensor, alpha: float, epsilon: float, method: str = "eigh") -> Tensor:
    """``(A + epsilon I)^(-alpha)`` for a symmetric PSD ``A`` (or a batch), float32, by ``method``."""
    if method == "eigh":
        return eigh_inverse_root(a, alpha, epsilon)
    if method == "newton":
        return newton_inverse_root(a, alpha, epsilon)[0]
    raise ValueError(f"root_inverse must be 'eigh' or 'newton', got {method!r}")
