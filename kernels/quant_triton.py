"""Triton block-wise quantize / dequantize (imported lazily: only CUDA tensors, or tests under TRITON_INTERPRET=1).

Bit-exact with ``quant_ref`` by construction: divisions use ``div_rn`` and square roots ``sqrt_rn`` (Triton's ``/``
and ``sqrt`` are approximate on NVIDIA), kernels are compiled with ``enable_fp_fusion=False`` (no mul+add -> fma
contraction), round-half-even is done with the 1.5 * 2**23 trick, and fp8 e4m3 bits are encoded and decoded with
integer arithmetic (the Triton interpreter's fp8 cast does not round to nearest even).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .qmaps import FP8_INV_MAX, FP8_MAX, INT8_INV_MAX, dynamic_tables

FMT_IDS = {"int8": 0, "dynamic": 1, "dynamic_unsigned": 2, "fp8_e4m3": 3}
# enable_fp_fusion=False: no mul+add -> fma contraction (Triton 3.9 fuses by default: 64 fma in the AdamW kernel's
# sm_90 PTX). enable_reflect_ftz=False: libdevice must not flush subnormals, which torch keeps (a precaution: the
# PTX has no .ftz either way today). tests/kernels/test_kernels_triton.py inspects the compiled PTX.
LAUNCH_OPTS = {"enable_fp_fusion": False, "enable_reflect_ftz": False}


def tile_shape(block_size: int, target_elems: int = 2048) -> tuple[int, int]:
    """(rows, row_pow2): a program handles ``rows`` blocks of ``block_size`` padded to a power of two."""
    row_pow2 = triton.next_power_of_2(block_size)
    return max(1, min(64, target_elems // row_pow2)), row_pow2


@triton.jit
def rint_f32(y):
    """Round half to even, for |y| < 2**22."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def to_bf16_rtne(x):
    """fp32 ``x`` as bf16, rounded to nearest (ties to even), by integer ops on its bits: the same on every backend
    (Triton's interpreter truncates and flushes subnormals where compiled code rounds). NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    top = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # the carry of a round-up runs into the exponent
    top = tl.where(x != x, 0x7FC0, top)
    return top.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def nearest_code(n, mids_ptr, lut_ptr, SHIFT: tl.constexpr, KEY_LO: tl.constexpr, LUT_LEN: tl.constexpr):
    """Number of table midpoints strictly below fp32 ``n`` (see qmaps.nearest_code), as int32."""
    bits = n.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    bucket = (key >> SHIFT) - KEY_LO
    bucket = tl.minimum(tl.maximum(bucket, 0), LUT_LEN - 1)
    base = tl.load(lut_ptr + bucket).to(tl.int32)
    nxt = tl.load(mids_ptr + base)
    return base + (nxt < n).to(tl.int32)


@triton.jit
def fp8e4m3_encode(y):
    """float8 e4m3fn bits (int32 in [0, 255]) of fp32 ``y`` with |y| <= 448, rounded to nearest even."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = bits & 0x7FFFFFFF
    # normal range (|y| >= 2**-6): round the fp32 mantissa to 3 bits, carry runs into the exponent; rebias 127 -> 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960
    # subnormal range: multiples of 2**-9 (code 8 is the smallest normal, 2**-6, so the carry is right too)
    sub = rint_f32(a.to(tl.float32, bitcast=True) * 512.0).to(tl.int32)
    return tl.where(a >= 0x3C800000, normal, sub) | (sign << 7)


@triton.jit
def fp8e4m3_decode(c):
    """fp32 value of float8 e4m3fn bits (int32 in [0, 255], no NaN)."""
    e = (c >> 3) & 15
    m = c & 7
    sign_bit = (c >> 7) << 31
    normal = (sign_bit | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125
    sub = tl.where(c >= 128, -sub, sub)
    return tl.where(e > 0, normal, sub)


@triton.jit
def quantize_tile(x, mask, mids_ptr, lut_ptr, FMT: tl.constexpr, SHIFT: tl.constexpr, KEY_LO: tl.constexpr,
                  LUT_LEN: tl.constexpr):  # fmt: skip
    """Quantize a [ROWS, COLS] fp32 tile, one block per row: (int32 codes, fp32 scales [ROWS])."""
    absmax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1)
    if FMT == 0:
        scale = absmax * INT8_INV_MAX_C
        y = tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0)[:, None])
        codes = rint_f32(tl.minimum(tl.maximum(y, -127.0), 127.0)).to(tl.int32)
    elif FMT == 3:
        scale = absmax * FP8_INV_MAX_C
        y = tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0)[:, None])
        codes = fp8e4m3_encode(tl.minimum(tl.maximum(y, -FP8_MAX_C), FP8_MAX_C))
    else:
        scale = absmax
        n = tl.math.div_rn(x, tl.where(absmax > 0, absmax, 1.0)[:, None])
        codes = nearest_code(n, mids_ptr, lut_ptr, SHIFT, KEY_LO, LUT_LEN)
        if FMT == 2:
            codes = tl.maximum(codes, (x > 0).to(tl.int32))  # a positive value never gets code 0
    return codes, scale


@triton.jit
def dequantize_tile(codes, scales, vals_ptr, FMT: tl.constexpr):
    """fp32 values of a [ROWS, COLS] tile of codes (int32; int8 codes sign-extended) with one scale per row."""
    if FMT == 0:
        vals = codes.to(tl.float32)
    elif FMT == 3:
        vals = fp8e4m3_decode(codes)
    else:
        vals = tl.load(vals_ptr + codes)
    return vals * scales[:, None]


INT8_INV_MAX_C = tl.constexpr(INT8_INV_MAX)
FP8_INV_MAX_C = tl.constexpr(FP8_INV_MAX)
FP8_MAX_C = tl.constexpr(FP8_MAX)


@triton.jit(do_not_specialize=["numel", "num_blocks", "BS"])
def _quantize_kernel(x_ptr, codes_ptr, scales_ptr, mids_ptr, lut_ptr, numel, num_blocks, BS,
                     ROWS: tl.constexpr, COLS: tl.constexpr, FMT: tl.constexpr, SHIFT: tl.constexpr,
                     KEY_LO: tl.constexpr, LUT_LEN: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, COLS)
    offs = row[:, None] * BS + col[None, :]
    mask = (col[None, :] < BS) & (offs < numel)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    codes, scale = quantize_tile(x, mask, mids_ptr, lut_ptr, FMT, SHIFT, KEY_LO, LUT_LEN)
    tl.store(codes_ptr + offs, codes.to(codes_ptr.dtype.element_ty), mask=mask)
    tl.store(scales_ptr + row, scale, mask=row < num_blocks)


@triton.jit(do_not_specialize=["numel", "num_blocks", "BS"])
def _dequantize_kernel(codes_ptr, scales_ptr, out_ptr, vals_ptr, numel, num_blocks, BS,
                       ROWS: tl.constexpr, COLS: tl.constexpr, FMT: tl.constexpr, OUT_BF16: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, COLS)
    offs = row[:, None] * BS + col[None, :]
    mask = (col[None, :] < BS) & (offs < numel)
    codes = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    scales = tl.load(scales_ptr + row, mask=row < num_blocks, other=0.0)
    vals = dequantize_tile(codes, scales, vals_ptr, FMT)
    if OUT_BF16:
        # round to nearest even by hand (out_ptr is the int16 view of a bf16 tensor): the interpreter's fp32 -> bf16
        # cast rounds ties up and can drop the mantissa carry; on a GPU this equals cvt.rn.bf16.f32
        bits = vals.to(tl.int32, bitcast=True)
        tl.store(out_ptr + offs, ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + offs, vals, mask=mask)


def _table_args(fmt: str, device: torch.device):
    if fmt in ("dynamic", "dynamic_unsigned"):
        t = dynamic_tables(fmt, device)
        return t.values, t.midpoints, t.lut, t.shift, t.key_lo, t.lut.numel()
    # unused by the int8 / fp8 paths, but the kernels want real pointers
    t = dynamic_tables("dynamic", device)
    return t.values, t.midpoints, t.lut, 0, 0, 1


def quantize_blockwise_triton(
    x: torch.Tensor, block_size: int, fmt: str, codes: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    numel = x.numel()
    if numel == 0:
        return codes, scales
    num_blocks = scales.numel()
    rows, cols = tile_shape(block_size)
    _, mids, lut, shift, key_lo, lut_len = _table_args(fmt, x.device)
    grid = (triton.cdiv(num_blocks, rows),)
    _quantize_kernel[grid](
        x, codes, scales, mids, lut, numel, num_blocks, BS=block_size, ROWS=rows, COLS=cols, FMT=FMT_IDS[fmt],
        SHIFT=shift, KEY_LO=key_lo, LUT_LEN=lut_len, **LAUNCH_OPTS,
    )  # fmt: skip
    return codes, scales


def dequantize_blockwise_triton(
    codes: torch.Tensor, scales: torch.Tensor, block_size: int, fmt: str, out: torch.Tensor
) -> torch.Tensor:
    numel = out.numel()
    if numel == 0:
        return out
    num_blocks = scales.numel()
    rows, cols = tile_shape(block_size)
    vals = _table_args(fmt, codes.device)[0]
    grid = (triton.cdiv(num_blocks, rows),)
    # fp32 and bf16 are written by the kernel; other dtypes through an fp32 buffer and torch's cast
    target = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    if out.dtype not in (torch.float32, torch.bfloat16):
        target = torch.empty(numel, dtype=torch.float32, device=out.device)
    _dequantize_kernel[grid](
        codes, scales, target, vals, numel, num_blocks, BS=block_size, ROWS=rows, COLS=cols, FMT=FMT_IDS[fmt],
        OUT_BF16=out.dtype == torch.bfloat16, **LAUNCH_OPTS,
    )  # fmt: skip
    if target.dtype == torch.float32 and target is not out:
        out.copy_(target)
    return out
