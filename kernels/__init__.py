"""Compute kernels (no distributed code): block quantization, fused 8-bit AdamW, Newton-Schulz."""
