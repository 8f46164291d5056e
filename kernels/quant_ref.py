"""Plain-torch reference of block-wise quantize / dequantize (any device; the dispatcher sends CPU tensors here).

Vectorised over blocks; the only Python loop walks chunks of whole blocks (~1M elements on CPU, so temporaries stay
cache-sized; ~64M on a GPU). The float
operations are the ones the Triton kernels perform, in the same order (see ``qmaps`` for the formats).
"""

from __future__ import annotations

import torch

from .qmaps import FP8_INV_MAX, FP8_MAX, INT8_INV_MAX, dynamic_tables, nearest_code

CHUNK_ELEMS = 1 << 20  # CPU: temporaries stay cache-sized
CHUNK_ELEMS_GPU = 1 << 26  # elsewhere: few, large launches


def chunk_elems_for(device: torch.device) -> int:
    return CHUNK_ELEMS if device.type == "cpu" else CHUNK_ELEMS_GPU


def block_rows(numel: int, block_size: int, chunk_elems: int = CHUNK_ELEMS):
    """Yield ``(elem_start, block_start, rows, row_len)`` pieces that tile ``numel`` elements: runs of whole blocks of
    ``block_size`` (at most ~chunk_elems elements each), then the short last block if there is one."""
    full = numel // block_size
    step = max(1, chunk_elems // block_size)
    for b0 in range(0, full, step):
        rows = min(step, full - b0)
        yield b0 * block_size, b0, rows, block_size
    tail = numel - full * block_size
    if tail:
        yield full * block_size, full, 1, tail


def quantize_rows(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of a 2-D fp32 tensor as one block: (codes like x, scales (rows,) fp32)."""
    absmax = x.abs().amax(dim=1)
    if fmt == "int8" or fmt == "fp8_e4m3":
        qmax = 127.0 if fmt == "int8" else FP8_MAX
        scale = absmax * (INT8_INV_MAX if fmt == "int8" else FP8_INV_MAX)
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
        y = (x / divisor[:, None]).clamp_(-qmax, qmax)
        if fmt == "int8":
            return torch.round(y).to(torch.int8), scale
        return y.to(torch.float8_e4m3fn).view(torch.uint8), scale
    divisor = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    codes = nearest_code(x / divisor[:, None], dynamic_tables(fmt, x.device))
    if fmt == "dynamic_unsigned":
        # a positive value never gets code 0 (see qmaps: UNSIGNED_FLOOR)
        codes = torch.maximum(codes, (x > 0).view(torch.uint8))
    return codes, absmax


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: fp32 values of a 2-D code tensor with one scale per row."""
    if fmt == "int8":
        vals = codes.to(torch.float32)
    elif fmt == "fp8_e4m3":
        vals = codes.view(torch.float8_e4m3fn).to(torch.float32)
    else:
        table = dynamic_tables(fmt, codes.device).values
        vals = torch.index_select(table, 0, codes.reshape(-1).int()).view(codes.shape)
    return vals * scales[:, None]


def quantize_blockwise_ref(
    x: torch.Tensor, block_size: int, fmt: str, codes: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.reshape(-1)
    for e0, b0, rows, n in block_rows(xf.numel(), block_size, chunk_elems_for(xf.device)):
        c, s = quantize_rows(xf[e0 : e0 + rows * n].view(rows, n).float(), fmt)
        codes[e0 : e0 + rows * n].copy_(c.view(-1))
        scales[b0 : b0 + rows].copy_(s)
    return codes, scales


def dequantize_blockwise_ref(
    codes: torch.Tensor, scales: torch.Tensor, block_size: int, fmt: str, out: torch.Tensor
) -> torch.Tensor:
    for e0, b0, rows, n in block_rows(out.numel(), block_size, chunk_elems_for(out.device)):
        vals = dequantize_rows(codes[e0 : e0 + rows * n].view(rows, n), scales[b0 : b0 + rows], fmt)
        out[e0 : e0 + rows * n].copy_(vals.view(-1))
    return out
