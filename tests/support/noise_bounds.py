"""Tolerances for "sharded == one process" comparisons, measured in the same run (imported by tests).

A sharded run adds the same gradient terms as one process in another order (per-rank micro-batches, gloo's
reduce-scatter, a division by W after the sum instead of before), so fp32 rounding makes the results differ in the
last bits. How much depends on the CPU's kernels (ATen's default, AVX2 or AVX-512 paths, bf16 units) and on the
thread count, so no constant holds on every machine: 1e-6 passed here and failed on an AVX-512-bf16 EPYC.

Each comparison therefore measures, in the same run, a reference whose only difference from the one-process result
is of the same kind -- the one-process run with another batching, or torch FSDP2 doing the same thing -- and allows
FACTOR times its gap, plus ULPS float32 ulps of the values compared (for when the reference happens to round the
same way as the one-process run). A real bug (a wrong grad slice, a missed reduce, a stale shard) moves values by
the learning rate or the gradient itself, orders of magnitude above both terms.
"""

from __future__ import annotations

import torch

# Measured on this project's 2-core AMD EPYC (AVX2), under ATEN_CPU_CAPABILITY=default and avx2 and 1 or 2
# threads: the sharded gap was at most 2x the larger of the two references (tests/sharding/test_runtime_equivalence.py).
FACTOR = 4.0
ULPS = 4
EPS32 = torch.finfo(torch.float32).eps


def max_abs_gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def max_rel_gap(a: dict, b: dict) -> float:
    """Per tensor, the largest difference over the largest magnitude of ``b``; the max over tensors."""
    assert a.keys() == b.keys()
    return max(
        ((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp(min=1e-30)).item() for k in a
    )


def allowed(reference_gap: float, scale: float = 0.0) -> float:
    """FACTOR x the reference's gap, plus ULPS float32 ulps of ``scale`` (the magnitude of the values compared;
    1.0 for relative gaps)."""
    return FACTOR * reference_gap + ULPS * EPS32 * scale


def magnitude(values: dict) -> float:
    return max(v.abs().max().item() for v in values.values())


def assert_within_reference(gap: float, reference_gap: float, scale: float, what: str) -> None:
    bound = allowed(reference_gap, scale)
    assert gap <= bound, (
        f"{what}: gap {gap:.3g} > {bound:.3g} (= {FACTOR:g} x the reference gap {reference_gap:.3g} measured in this "
        f"run + {ULPS} float32 ulps of {scale:.3g})"
    )


def rel(a, b):
    """The largest |a - b| relative to the largest |b|, in float64 (the SOAP tests' distance)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()
