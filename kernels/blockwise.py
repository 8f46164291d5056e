"""Public block-wise quantize / dequantize with device dispatch: CUDA tensors -> Triton, others -> torch reference.

``impl`` forces one side: ``"torch"`` or ``"triton"`` (the latter on CPU tensors needs ``TRITON_INTERPRET=1`` set
before triton is first imported). Triton is imported only when it is chosen, so this package imports on machines
where Triton has no usable driver.
"""

from __future__ import annotations

import functools

import torch

from .qmaps import check_format
from .quant_ref import dequantize_blockwise_ref, quantize_blockwise_ref

IMPLS = (None, "torch", "triton")


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def choose_impl(t: torch.Tensor, impl: str | None) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl is None:
        return "triton" if t.is_cuda and triton_importable() else "torch"
    return impl


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def code_dtype(fmt: str) -> torch.dtype:
    """Storage dtype of the codes: int8 for 'int8', uint8 for the others (fp8 codes are float8_e4m3fn bits)."""
    return torch.int8 if fmt == "int8" else torch.uint8


def _flat(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous (got strides {t.stride()}); pass t.contiguous()")
    return t.view(-1)


def quantize_blockwise(
    x: torch.Tensor,
    block_size: int,
    fmt: str,
    *,
    codes: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize flat ``x`` (fp32/bf16/fp16, any shape read as flat) in blocks of ``block_size`` elements (the last
    may be short). Returns ``(codes, scales)``: codes shaped like flat x (``code_dtype(fmt)``), one fp32 scale per
    block. ``codes`` / ``scales`` may be given to write in place."""
    check_format(fmt)
    check_block_size(block_size)
    if not x.is_floating_point():
        raise ValueError(f"quantize_blockwise needs a floating tensor, got {x.dtype}")
    xf = _flat(x, "x")
    nb = num_blocks(xf.numel(), block_size)
    if codes is None:
        codes = torch.empty(xf.numel(), dtype=code_dtype(fmt), device=x.device)
    if scales is None:
        scales = torch.empty(nb, dtype=torch.float32, device=x.device)
    _check_state(codes, scales, xf.numel(), nb, fmt, x.device)
    if choose_impl(x, impl) == "triton":
        from .quant_triton import quantize_blockwise_triton

        return quantize_blockwise_triton(xf, block_size, fmt, codes, scales)
    return quantize_blockwise_ref(xf, block_size, fmt, codes, scales)


def dequantize_blockwise(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block_size: int,
    fmt: str,
    numel: int | None = None,
    out: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    impl: str | None = None,
) -> torch.Tensor:
    """Values of ``codes`` (flat) with one scale per block, as a flat tensor of ``numel`` elements (default: all of
    ``codes``) in ``out`` (or a new tensor of ``dtype``)."""
    check_format(fmt)
    check_block_size(block_size)
    if numel is None:
        numel = codes.numel()
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=codes.device)
    of = _flat(out, "out")
    if of.numel() != numel:
        raise ValueError(f"out has {of.numel()} elements, expected numel={numel}")
    _check_state(codes, scales, numel, num_blocks(numel, block_size), fmt, codes.device)
    cf = codes.view(-1)[:numel]
    if choose_impl(codes, impl) == "triton":
        from .quant_triton import dequantize_blockwise_triton

        dequantize_blockwise_triton(cf, scales, block_size, fmt, of)
    else:
        dequantize_blockwise_ref(cf, scales, block_size, fmt, of)
    return out


def _check_state(codes: torch.Tensor, scales: torch.Tensor, numel: int, nb: int, fmt: str, device) -> None:
    want = code_dtype(fmt)
    if codes.dtype != want or not codes.is_contiguous() or codes.numel() < numel:
        raise ValueError(
            f"codes must be a contiguous {want} tensor of >= {numel} elements for fmt={fmt!r}, "
            f"got {codes.dtype} with {codes.numel()}"
        )
    if scales.dtype != torch.float32 or not scales.is_contiguous() or scales.numel() != nb:
        raise ValueError(
            f"scales must be a contiguous float32 tensor of {nb} blocks, got {scales.dtype} {scales.shape}"
        )
    if codes.device != torch.device(device) or scales.device != torch.device(device):
        raise ValueError(f"codes ({codes.device}) and scales ({scales.device}) must be on {device}")
