"""Plain-torch reference of the fused 8-bit AdamW step (any device; the dispatcher sends CPU tensors here), for
any pair of state formats: the fused kernel's pair (``"dynamic"``, ``"dynamic_unsigned"``) by default, other pairs
for the optimizer's unfused path, which compares quantization maps.

Per block, in this exact order of fp32 operations (the Triton kernel performs the same ones; every constant is an
fp32 value computed once on the host by :func:`adamw8bit_constants`). The second moment is stored as its square
root ``r = sqrt(v)`` (see :mod:`ragged_optim.kernels.adamw8bit`):

    m = dequantize(m_code, m_scale, m_fmt)    r = dequantize(v_code, v_scale, v_fmt);  v = r * r
    p = p * decay                             decay = 1 - lr * weight_decay
    m = b1 * m + c1 * g                       c1 = 1 - b1
    v = b2 * v + (c2 * g) * g                 c2 = 1 - b2 (c2 * g first: g * g overflows at 1.8e19)
    v = min(v, FLT_MAX)                       (a v that overflowed to inf: its block's scale stays finite)
    r = sqrt(v)
    bound = r * m_bound                       m_bound = C_t of adamw8bit_m_bound (|m| <= C_t sqrt(v) in exact Adam)
    m = bound if m > bound; -bound if m < -bound; else m
    denom = r * inv_sqrt_bc2 + eps            inv_sqrt_bc2 = 1 / sqrt(1 - b2**step)
    p = p - step_size * (m / denom)           step_size = lr / (1 - b1**step)
    m_code, m_scale = quantize(m, m_fmt);  v_code, v_scale = quantize(r, v_fmt)

No multiply-add is fused and every division and square root is IEEE round-to-nearest. A bf16 or fp16 ``p`` is
read as fp32, updated as above and stored rounded to the nearest (even) value once, at the end. Note: torch's CPU
``sqrt`` on fp32 (AVX2 build, torch 2.13) is *not* correctly rounded (about 1 in 5 results is 1 ulp off), so on CPU
the reference takes the square root with numpy (hardware ``sqrtps``, IEEE); CUDA's ``sqrtf`` is IEEE already.
"""

from __future__ import annotations

import numpy as np
import torch

from .quant_ref import block_rows, chunk_elems_for, dequantize_rows, quantize_rows

# The largest float32. A gradient beyond ~1e19 makes v overflow to inf; an inf block scale then turned every
# code of the block into NaN (0 * inf) or inf at the next step, for good.
FLT_MAX = float(torch.finfo(torch.float32).max)
#: (first moment format, second moment format) of the fused kernel.
FUSED_FORMATS = ("dynamic", "dynamic_unsigned")


def ieee_sqrt_(t: torch.Tensor) -> torch.Tensor:
    """In-place, correctly rounded square root of a contiguous fp32 tensor."""
    if t.device.type == "cpu":
        a = t.numpy()
        np.sqrt(a, out=a)
        return t
    return t.sqrt_()


def adamw8bit_ref(
    p: torch.Tensor,
    g: torch.Tensor,
    m_codes: torch.Tensor,
    m_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    block_size: int,
    consts: tuple[float, ...],
    formats: tuple[str, str] = FUSED_FORMATS,
) -> None:
    """One step on flat, contiguous ``p``/``g`` and their state, in place; ``formats`` = ``(m_fmt, v_fmt)`` of the
    codes; ``consts``: :func:`adamw8bit_constants` followed by the first moment's bound ``C_t``."""
    decay, b1, c1, b2, c2, inv_sqrt_bc2, eps, step_size, m_bound = consts
    m_fmt, v_fmt = formats
    for e0, b0, rows, n in block_rows(p.numel(), block_size, chunk_elems_for(p.device)):
        e1 = e0 + rows * n
        p_out = p[e0:e1].view(rows, n)
        pb = p_out if p_out.dtype == torch.float32 else p_out.float()
        gb = g[e0:e1].view(rows, n).float()
        m = dequantize_rows(m_codes[e0:e1].view(rows, n), m_scales[b0 : b0 + rows], m_fmt)
        r = dequantize_rows(v_codes[e0:e1].view(rows, n), v_scales[b0 : b0 + rows], v_fmt)
        v = r.mul_(r)
        pb.mul_(decay)
        m.mul_(b1).add_(gb * c1)
        v.mul_(b2).add_((gb * c2).mul_(gb)).clamp_(max=FLT_MAX)
        r = ieee_sqrt_(v)
        bound = r * m_bound
        m = torch.where(m > bound, bound, torch.where(m < -bound, -bound, m))
        denom = (r * inv_sqrt_bc2).add_(eps)
        pb.sub_(torch.div(m, denom).mul_(step_size))
        if pb is not p_out:
            p_out.copy_(pb)
        mc, ms = quantize_rows(m, m_fmt)
        vc, vs = quantize_rows(r, v_fmt)
        m_codes[e0:e1].copy_(mc.view(-1))
        m_scales[b0 : b0 + rows].copy_(ms)
        v_codes[e0:e1].copy_(vc.view(-1))
        v_scales[b0 : b0 + rows].copy_(vs)
