"""How well ways of storing Adam's second moment in 8 bits track the exact one, on synthetic gradient streams.

Blocks of 256 elements whose gradient scales spread over two decades get 300 steps of Gaussian or heavy-tailed
(Student-t, 3 degrees of freedom) gradients; ``v`` follows ``v = b2 * v + (1 - b2) * g * g`` (b2 0.95) exactly and
through each stored format, which is re-quantized every step from its own dequantized value (as an 8-bit
optimizer does). Formats, all on the unsigned dynamic-tree map with the zero floor (a non-zero value never decodes
to 0):

- ``sqrt(v), absmax``: the square root, block scale = its largest magnitude (ro.AdamW8bit);
- ``v, absmax``: ``v`` itself (bitsandbytes' choice);
- ``sqrt(v), stochastic``: as ours, rounded stochastically between the two nearest codes (unbiased);
- ``sqrt(v), pow2 scale``: as ours, with the scale rounded up to a power of two (it changes in jumps only).

Per format: the relative error of the stored ``sqrt(v)`` (mean, median, the fractions more than 5% low / high) and
the rms relative error of ``1 / sqrt(v)``, which is what the update multiplies by.

    python benchmarks/adamw8bit_v_formats.py

Prints one JSON line per (gradients, format); about a minute here.
"""

from __future__ import annotations

import json

import torch

from ragged_optim.kernels.qmaps import dynamic_tree_values
from ragged_optim.kernels.quant_ref import dequantize_rows, quantize_rows

B2, STEPS, ROWS, BLOCK = 0.95, 300, 200, 256
_TABLE = torch.tensor(sorted(dynamic_tree_values(signed=False)), dtype=torch.float32)


def _floor(x, y, scale):
    """The zero floor: a positive value stored as 0 becomes the map's smallest positive code."""
    return torch.where((x > 0) & (y == 0), scale * _TABLE[1], y)


def _nearest(x):
    codes, scales = quantize_rows(x, "dynamic_unsigned")
    return _floor(x, dequantize_rows(codes, scales, "dynamic_unsigned"), scales[:, None])


def _stochastic(x, gen):
    scale = x.amax(dim=1, keepdim=True).clamp_min(1e-30)
    n = (x / scale).contiguous()
    hi = torch.searchsorted(_TABLE, n).clamp(1, len(_TABLE) - 1)
    lo, hi_v = _TABLE[hi - 1], _TABLE[hi]
    up = torch.rand(n.shape, generator=gen) < (n - lo) / (hi_v - lo)
    return _floor(x, torch.where(up, hi_v, lo) * scale, scale)


def _pow2_scale(x):
    scale = torch.exp2(torch.ceil(torch.log2(x.amax(dim=1, keepdim=True).clamp_min(1e-30))))
    mids = (_TABLE[1:] + _TABLE[:-1]) / 2
    return _floor(x, _TABLE[torch.searchsorted(mids, (x / scale).contiguous())] * scale, scale)


FORMATS = ("sqrt(v), absmax", "v, absmax", "sqrt(v), stochastic", "sqrt(v), pow2 scale")


def run(gradients: str, fmt: str, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    sigma = 10 ** (-2 * torch.rand(ROWS, BLOCK, generator=gen))
    t_dist = torch.distributions.StudentT(3.0)
    v = torch.zeros(ROWS, BLOCK)
    stored = torch.zeros(ROWS, BLOCK)
    for _ in range(STEPS):
        if gradients == "gaussian":
            g = torch.randn(ROWS, BLOCK, generator=gen) * sigma
        else:
            torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))  # StudentT draws from the global RNG
            g = t_dist.sample((ROWS, BLOCK)) * sigma
        v = B2 * v + (1 - B2) * g * g
        if fmt == "v, absmax":
            stored = _nearest(B2 * stored + (1 - B2) * g * g)
            continue
        r = (B2 * stored * stored + (1 - B2) * g * g).sqrt()
        stored = _nearest(r) if fmt == "sqrt(v), absmax" else (
            _stochastic(r, gen) if fmt == "sqrt(v), stochastic" else _pow2_scale(r))  # fmt: skip
    r_exact = v.sqrt()
    r_stored = stored.sqrt() if fmt == "v, absmax" else stored
    ok = r_exact > 0
    rel = (r_stored[ok] - r_exact[ok]) / r_exact[ok]
    inv = r_exact[ok] / r_stored[ok] - 1
    return {
        "gradients": gradients,
        "format": fmt,
        "sqrt_v_rel_err_mean": round(rel.mean().item(), 4),
        "sqrt_v_rel_err_median": round(rel.median().item(), 4),
        "frac_over_5pct_low": round((rel < -0.05).float().mean().item(), 3),
        "frac_over_5pct_high": round((rel > 0.05).float().mean().item(), 3),
        "inv_sqrt_v_rms_rel_err": round(inv.pow(2).mean().sqrt().item(), 4),
    }


def main() -> None:
    torch.set_num_threads(1)
    for gradients in ("gaussian", "student-t"):
        for fmt in FORMATS:
            print(json.dumps(run(gradients, fmt)), flush=True)


if __name__ == "__main__":
    main()
