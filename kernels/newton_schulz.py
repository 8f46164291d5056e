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
``batched_matmul=True`` option trades that guarantee for ``torch.baddbmm``). tests/optim/muon/test_muon_one_process.py
checks both.

How the matmuls run (``matmul``): ``"native"`` calls them in the compute dtype, as torch.optim.Muon does.
``"upcast"`` keeps every operand and result rounded to the compute dtype but runs each matmul in float32 and rounds
its output once: bf16 storage with fp32 accumulation, which is what a bf16 GEMM does on tensor cores and on CPUs
that have one. It differs from ``"native"`` only in the fp32 summation order inside a matmul (on CPU, torch 2.13:
``addmm`` bitwise equal, the Gram matrix 1 ulp apart in ~0.02% of elements). Five iterations amplify such flips,
as they would between any two bf16 GEMM backends: the two results are 1-2% of the largest entry apart, and each is
as far from the fp32 result as the other (tests/kernels/test_newton_schulz_matmul.py measures both). ``"auto"`` (the
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
    "SMALL_BATCH_MAX_BYTES",
    "SMALL_BATCH_MAX_MATRICES",
    "batched_is_exact",
    "batching_pays",
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
            but not always in fp32), and the default keeps ``newton_schulz(G)[i] == newton_schulz(G[i])`` bit for
            bit on every backend; :func:`batched_is_exact` tells where the two agree.
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


#: When one ``batched_matmul=True`` call over same-shape matrices beats a call per matrix. Measured on a CPU (torch
#: 2.13, oneDNN bf16, one thread; time per matrix over time batched): 8 x 64x64 4.6, 8 x 128x128 2.05, 8 x 256x128
#: 1.63, 6 x 128x512 1.14, but 8 x 256x256 0.88 and 8 x 512x512 0.78: a fixed cost per oneDNN call dominates small
#: matrices only, and fp32 gained at most 1.05 at these sizes. So bf16/fp16 with native matmuls, ``m^2 n <= 128^2 *
#: 512`` (m <= n: the Gram matrix's side), at most 8 matrices a call (which also bounds the updates a batch keeps
#: alive). And ``m >= 32``: torch runs a bf16 2-D matmul through oneDNN only above 16^3 multiply-adds, a batched one
#: above that in all, so a 16x16 matrix's 2-D and batched matmuls are different kernels (they differed in 4 of 200
#: Gram matrices); from 17x17 up they were the same bits in every one of 1,900 matrices (1 and 2 threads, batches of
#: 2, 3, 8, scales 1e-2..1e2).
_SMALL_BATCH_MAX_MMN = 128 * 128 * 512
_SMALL_BATCH_MIN_SIDE = 32
SMALL_BATCH_MAX_MATRICES = 8
#: What the batches of one step may hold at once (ns-dtype bytes): one full batch of the largest matrix that
#: :func:`batching_pays` takes, 32 x 8192 in bf16 (4 MiB).
SMALL_BATCH_MAX_BYTES = SMALL_BATCH_MAX_MATRICES * (_SMALL_BATCH_MAX_MMN // _SMALL_BATCH_MIN_SIDE) * 2


def batching_pays(m: int, n: int, dtype: torch.dtype, device: torch.device | str, matmul: str) -> bool:
    """True where same-shape ``m x n`` matrices orthogonalize faster in one batched call than one call each, with
    the same kernels (see :data:`SMALL_BATCH_MAX_MATRICES`). CPU only: a GPU's batched kernels are unmeasured here."""
    if torch.device(device).type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return False
    small, large = min(m, n), max(m, n)
    if small < _SMALL_BATCH_MIN_SIDE or small * small * large > _SMALL_BATCH_MAX_MMN:
        return False
    return resolve_ns_matmul(matmul, dtype, device) == "native"


def batched_is_exact(
    batch: int,
    m: int,
    n: int,
    in_dtype: torch.dtype,
    device: torch.device | str,
    *,
    steps: int,
    coefficients: tuple[float, float, float],
    eps: float,
    dtype: torch.dtype,
    matmul: str,
) -> bool:
    """Whether :func:`newton_schulz` with ``batched_matmul=True`` gave every matrix of a ``[batch, m, n]`` stack
    (``in_dtype``) exactly what that matrix gives alone, on this device with these settings, in a probe: three
    seeded random stacks (scales 1e-2, 1, 1e2), once per (shapes, dtypes, device, settings, thread count). A
    batched kernel that sums in another order than the 2-D one differs somewhere in such a probe (a 16x16 matrix's
    differed in a quarter of its Newton-Schulz results); one that is the same kernel never does."""
    device = torch.device(device)
    key = (batch, m, n, in_dtype, device, steps, tuple(coefficients), eps, dtype)
    return _probe_batched(*key, resolve_ns_matmul(matmul, dtype, device), torch.get_num_threads())


@functools.cache
def _probe_batched(batch, m, n, in_dtype, device, steps, coefficients, eps, dtype, matmul, _threads) -> bool:
    kw = dict(steps=steps, coefficients=coefficients, eps=eps, dtype=dtype, matmul=matmul, out_dtype=dtype)
    for seed, scale in enumerate((1e-2, 1.0, 1e2)):
        G = torch.randn(batch, m, n, generator=torch.Generator().manual_seed(seed)) * scale
        G = G.to(device=device, dtype=in_dtype)
        try:
            together = newton_schulz(G, batched_matmul=True, **kw)
        except (RuntimeError, NotImplementedError):  # a backend without that batched kernel: one call per matrix
            return False
        if not all(torch.equal(together[i], newton_schulz(G[i], **kw)) for i in range(batch)):
            return False
    return True


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
