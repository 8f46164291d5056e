"""Compute kernels (no distributed code): block quantization, fused 8-bit AdamW, Newton-Schulz.

Every kernel has a plain-torch reference and a Triton implementation; CUDA tensors take Triton, CPU tensors the
reference (``impl=`` overrides). Triton is imported lazily, so this package imports where Triton cannot run.
"""

from .adamw8bit import (
    PARAM_DTYPES,
    STATE_FORMAT_VERSION,
    adamw8bit_constants,
    adamw8bit_m_bound,
    adamw8bit_m_bound_of,
    adamw8bit_m_bound_sq_next,
    adamw8bit_step,
    init_adamw8bit_state,
)
from .blockwise import code_dtype, dequantize_blockwise, num_blocks, quantize_blockwise
from .qmaps import FORMATS, dynamic_tables

__all__ = [
    "FORMATS",
    "PARAM_DTYPES",
    "STATE_FORMAT_VERSION",
    "adamw8bit_constants",
    "adamw8bit_m_bound",
    "adamw8bit_m_bound_of",
    "adamw8bit_m_bound_sq_next",
    "adamw8bit_step",
    "code_dtype",
    "dequantize_blockwise",
    "dynamic_tables",
    "init_adamw8bit_state",
    "num_blocks",
    "quantize_blockwise",
]
