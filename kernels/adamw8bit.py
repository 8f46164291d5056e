"""Public fused 8-bit AdamW step with device dispatch (CUDA tensors -> Triton, others -> torch reference).

State layout per param chunk of ``numel`` elements in blocks of ``block_size`` (last block may be short):
``m_codes``/``v_codes`` uint8 (numel,), ``m_scales``/``v_scales`` fp32 (num_blocks,). First moment ``m`` in the
signed dynamic map; the second moment as its square root ``sqrt(v)`` in the unsigned one, whose codes never round a
positive value to 0. Everything is updated in place. A block's result depends only on that block's data, so any
run of whole blocks can be stepped on its own (sharded == unsharded, bit for bit).

Why ``sqrt(v)`` (state format version 2; version 1 stored ``v``). An element whose gradient is ~1e-4 of its block's
largest has ``m`` at ~1e-4 of the block's ``m`` scale but ``v`` at ~1e-8 of ``v``'s: below the unsigned map's
smallest code (1e-7), so ``v`` decoded to 0 while ``m`` did not and the update was ``lr * m_hat / eps``: hundreds
of lr. ``sqrt(v)`` spans the same decades as ``m``, so such an element keeps 4-5 significant bits; the zero floor
of the map covers what is still smaller. The state stays one byte per element and moment.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .adamw8bit_ref import adamw8bit_ref
from .blockwise import check_block_size, choose_impl, num_blocks

#: The dtypes of params :func:`adamw8bit_step` updates (the arithmetic is fp32 either way).
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: What the 8-bit state means: 2 = ``v`` stored as ``sqrt(v)`` with the zero floor; 1 = ``v`` itself.
STATE_FORMAT_VERSION = 2


def _f32(x: float) -> float:
    """``x`` rounded to float32, on the host (numpy, not a tensor: nothing here reads tensor data); beyond
    float32's range, inf, without numpy's overflow warning (a bound C_t that grows without limit when
    beta1**2 > beta2 is inf by design)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def adamw8bit_constants(
    step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float
) -> tuple[float, ...]:
    """The fp32 constants of one step, computed in float64 on the host and rounded once:
    (decay, b1, 1-b1, b2, 1-b2, 1/sqrt(1-b2**step), eps, lr/(1-b1**step))."""
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    bc1 = 1.0 - beta1**step
    bc2 = 1.0 - beta2**step
    vals = (1.0 - lr * weight_decay, beta1, 1.0 - beta1, beta2, 1.0 - beta2, 1.0 / math.sqrt(bc2), eps, lr / bc1)
    return tuple(_f32(v) for v in vals)


def adamw8bit_m_bound(step: int, beta1: float, beta2: float) -> float:
    """``C_t``: exact Adam from zero state has ``|m_t| <= C_t * sqrt(v_t)`` at step ``t`` (Cauchy-Schwarz on the two
    moving sums: ``C_t = (1 - b1) * sqrt(sum_{k<t} (b1**2 / b2)**k / (1 - b2))``), as an fp32 value (inf when
    unbounded). The kernel clamps the updated ``m`` into ``[-C_t r, C_t r]``: a no-op for exact moments, it removes
    what quantization error adds (an ``m`` rounded up next to an ``r`` rounded down), so the step is at most
    ``lr * C_t * sqrt(1 - b2**t) / (1 - b1**t)`` (1.0 at t=1, 1.17 later, for betas (0.9, 0.95)), as fp32 AdamW's."""
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    if beta2 == 0.0:
        return math.inf
    q = beta1 * beta1 / beta2
    try:
        s = float(step) if q == 1.0 else (q**step - 1.0) / (q - 1.0)
    except OverflowError:
        return math.inf
    return _f32((1.0 - beta1) * math.sqrt(s / (1.0 - beta2)))


def adamw8bit_m_bound_sq_next(prev: float, beta1: float, beta2: float) -> float:
    """``C_t**2`` after one more step with these betas, from ``C_(t-1)**2`` (0 before step 1): with betas that change
    between steps (a schedule, or ``param_groups`` edited), ``m_t = sum_k a_k g_(t-k)`` and ``v_t = sum_k c_k
    g_(t-k)**2`` have other weights than :func:`adamw8bit_m_bound` assumes, and Cauchy-Schwarz gives ``C_t**2 =
    sum_k a_k**2 / c_k``, which each step maps to ``(1-b1)**2 / (1-b2) + (b1**2 / b2) * C_(t-1)**2``. For constant
    betas it is :func:`adamw8bit_m_bound` squared (up to float64 rounding). inf when unbounded (``beta2 == 0``)."""
    if beta2 == 0.0 or math.isinf(prev):
        return math.inf
    return (1.0 - beta1) ** 2 / (1.0 - beta2) + beta1 * beta1 / beta2 * prev


def adamw8bit_m_bound_of(bound_sq: float) -> float:
    """``C_t`` as the kernels take it (an fp32 value) from :func:`adamw8bit_m_bound_sq_next`'s running value."""
    return _f32(math.sqrt(bound_sq))


def init_adamw8bit_state(numel: int, block_size: int, device=None) -> dict[str, torch.Tensor]:
    """Zero state (both moments exactly 0) for a chunk of ``numel`` elements."""
    nb = num_blocks(numel, block_size)
    s = torch.zeros(nb, dtype=torch.float32, device=device)
    return {
        # code 0 of the unsigned map is 0.0; for the signed map the zero code is found by quantizing 0
        "m_codes": torch.full((numel,), _signed_zero_code(), dtype=torch.uint8, device=device),
        "m_scales": s,
        "v_codes": torch.zeros(numel, dtype=torch.uint8, device=device),
        "v_scales": s.clone(),
    }


def _signed_zero_code() -> int:
    from .qmaps import dynamic_tables, nearest_code

    return int(nearest_code(torch.zeros(1), dynamic_tables("dynamic")).item())


def adamw8bit_step(
    p: torch.Tensor,
    g: torch.Tensor,
    m_codes: torch.Tensor,
    m_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    block_size: int = 256,
    impl: str | None = None,
    m_bound: float | None = None,
) -> None:
    """One AdamW step on a contiguous run of whole blocks, in place on ``p`` and the four state tensors.

    ``p`` fp32/bf16/fp16 (bf16/fp16: computed in fp32, stored rounded to nearest once), ``g`` fp32/bf16/fp16 (same
    numel), ``step`` is the 1-based step count after this update. Update
    (decoupled weight decay): ``p *= 1 - lr*wd; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g;
    m = clamp(m, -C_t sqrt(v), C_t sqrt(v))`` (:func:`adamw8bit_m_bound`: a no-op for exact moments);
    ``p -= lr/(1-b1**t) * m / (sqrt(v)/sqrt(1-b2**t) + eps)``, then ``m`` and ``sqrt(v)`` are requantized per
    block (``v_codes``/``v_scales`` hold ``sqrt(v)``). ``m_bound``: ``C_t`` when the betas changed during the run
    (``sqrt`` of :func:`adamw8bit_m_bound_sq_next`'s running value); None: constant betas, from ``step``."""
    check_block_size(block_size)
    n = p.numel()
    nb = num_blocks(n, block_size)
    if p.dtype not in PARAM_DTYPES:
        raise ValueError(f"adamw8bit_step needs a param chunk of one of {PARAM_DTYPES}, got {p.dtype}")
    if g.numel() != n or not g.is_floating_point():
        raise ValueError(f"grad must be a floating tensor of {n} elements, got {g.dtype} with {g.numel()}")
    for name, t, dt, size in (
        ("p", p, p.dtype, n),
        ("g", g, g.dtype, n),
        ("m_codes", m_codes, torch.uint8, n),
        ("v_codes", v_codes, torch.uint8, n),
        ("m_scales", m_scales, torch.float32, nb),
        ("v_scales", v_scales, torch.float32, nb),
    ):
        if t.dtype != dt or t.numel() != size or not t.is_contiguous() or t.device != p.device:
            raise ValueError(
                f"{name} must be a contiguous {dt} tensor of {size} elements on {p.device} "
                f"(block_size={block_size}), got {t.dtype} {tuple(t.shape)} on {t.device}"
            )
    bound = adamw8bit_m_bound(step, beta1, beta2) if m_bound is None else _f32(m_bound)
    consts = (*adamw8bit_constants(step, lr, beta1, beta2, eps, weight_decay), bound)
    args = (p.view(-1), g.view(-1), m_codes.view(-1), m_scales, v_codes.view(-1), v_scales, block_size, consts)
    if choose_impl(p, impl) == "triton":
        from .adamw8bit_triton import adamw8bit_triton

        adamw8bit_triton(*args)
    else:
        adamw8bit_ref(*args)
