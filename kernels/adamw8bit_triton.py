"""Triton fused 8-bit AdamW step: one pass per tile of whole blocks, bit-exact with ``adamw8bit_ref``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .adamw8bit_ref import FLT_MAX
from .qmaps import dynamic_tables
from .quant_triton import LAUNCH_OPTS, dequantize_tile, quantize_tile, tile_shape, to_bf16_rtne

_FLT_MAX = tl.constexpr(FLT_MAX)  # (a jit function reads constexpr globals only)


@triton.jit(do_not_specialize=["numel", "num_blocks", "BS"])
def _adamw8bit_kernel(p_ptr, g_ptr, mc_ptr, ms_ptr, vc_ptr, vs_ptr,
                      s_vals, s_mids, s_lut, u_vals, u_mids, u_lut,
                      numel, num_blocks, decay, b1, c1, b2, c2, inv_sqrt_bc2, eps, step_size, m_bound,
                      BS, ROWS: tl.constexpr, COLS: tl.constexpr,
                      S_SHIFT: tl.constexpr, S_KEY_LO: tl.constexpr, S_LUT_LEN: tl.constexpr,
                      U_SHIFT: tl.constexpr, U_KEY_LO: tl.constexpr, U_LUT_LEN: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, COLS)
    offs = row[:, None] * BS + col[None, :]
    mask = (col[None, :] < BS) & (offs < numel)
    rmask = row < num_blocks
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # (a bf16/fp16 param: computed in fp32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = dequantize_tile(
        tl.load(mc_ptr + offs, mask=mask, other=0).to(tl.int32), tl.load(ms_ptr + row, mask=rmask, other=0.0),
        s_vals, 1,
    )  # fmt: skip
    r = dequantize_tile(
        tl.load(vc_ptr + offs, mask=mask, other=0).to(tl.int32), tl.load(vs_ptr + row, mask=rmask, other=0.0),
        u_vals, 2,
    )  # fmt: skip
    v = r * r  # the state holds sqrt(v)
    p = p * decay
    m = m * b1 + g * c1
    v = tl.minimum(v * b2 + (g * c2) * g, _FLT_MAX)  # (see adamw8bit_ref: the same order, the same clamp)
    r = tl.sqrt_rn(v)
    bound = r * m_bound
    m = tl.where(m > bound, bound, tl.where(m < -bound, -bound, m))  # |m| <= C_t sqrt(v), as in exact Adam
    denom = r * inv_sqrt_bc2 + eps
    p = p - tl.math.div_rn(m, denom) * step_size
    if p_ptr.dtype.element_ty == tl.bfloat16:  # a bf16 param: rounded to nearest (even) once, as torch's copy_
        tl.store(p_ptr + offs, to_bf16_rtne(p), mask=mask)
    else:
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    mc, ms = quantize_tile(m, mask, s_mids, s_lut, 1, S_SHIFT, S_KEY_LO, S_LUT_LEN)
    tl.store(mc_ptr + offs, mc.to(tl.uint8), mask=mask)
    tl.store(ms_ptr + row, ms, mask=rmask)
    vc, vs = quantize_tile(r, mask, u_mids, u_lut, 2, U_SHIFT, U_KEY_LO, U_LUT_LEN)
    tl.store(vc_ptr + offs, vc.to(tl.uint8), mask=mask)
    tl.store(vs_ptr + row, vs, mask=rmask)


def adamw8bit_triton(
    p: torch.Tensor,
    g: torch.Tensor,
    m_codes: torch.Tensor,
    m_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    block_size: int,
    consts: tuple[float, ...],
) -> None:
    numel = p.numel()
    if numel == 0:
        return
    num_blocks = m_scales.numel()
    rows, cols = tile_shape(block_size)
    s = dynamic_tables("dynamic", p.device)
    u = dynamic_tables("dynamic_unsigned", p.device)
    grid = (triton.cdiv(num_blocks, rows),)
    _adamw8bit_kernel[grid](
        p, g, m_codes, m_scales, v_codes, v_scales, s.values, s.midpoints, s.lut, u.values, u.midpoints, u.lut,
        numel, num_blocks, *consts, BS=block_size, ROWS=rows, COLS=cols,
        S_SHIFT=s.shift, S_KEY_LO=s.key_lo, S_LUT_LEN=s.lut.numel(),
        U_SHIFT=u.shift, U_KEY_LO=u.key_lo, U_LUT_LEN=u.lut.numel(), **LAUNCH_OPTS,
    )  # fmt: skip
