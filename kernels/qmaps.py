"""Code tables for block-wise quantization, and the exact nearest-code lookup shared by every implementation.

Formats (the ``fmt`` argument everywhere in this package):

- ``"int8"``: absmax int8, ``scale = absmax * fp32(1/127)``, ``code = rint(clamp(x / scale, -127, 127))``.
- ``"dynamic"``: the signed 8-bit dynamic-tree map (first Adam moment), ``scale = absmax``.
- ``"dynamic_unsigned"``: the unsigned dynamic-tree map (second Adam moment), ``scale = absmax``.
- ``"fp8_e4m3"``: float8 e4m3fn bits, ``scale = absmax * fp32(1/448)``.

Dynamic-tree map (Dettmers et al., "8-bit optimizers via block-wise quantization", built from its definition): a
code is a sign bit (signed map only), then ``E`` zero bits (the decimal exponent, value scale ``10**-E``), then an
indicator bit set to one, then ``F`` fraction bits that split the decade ``(0.1, 1] * 10**-E`` linearly into
``2**F`` steps whose top step is exactly ``10**-E``. With no indicator bit at all the code is zero. The unsigned
map spends the sign bit on one more fraction bit. So the signed map has 127 positive values (1e-6 .. 1.0), their
negatives and zero (stored twice: +0 and -0); the unsigned map has 255 positive values (1e-7 .. 1.0) and zero.
Both contain exactly 0 and 1, so a zero block and the block's absmax element round-trip exactly.

Zero floor of the unsigned map: quantizing gives a positive value at least code 1 (the smallest positive value,
``1e-7 * scale``) even where 0 is nearer, so code 0 means exactly 0. The unsigned map holds the square root of
Adam's second moment, which the update divides by: a non-zero one that decoded to 0 would turn
``m / (sqrt(v) + eps)`` into ``m / eps`` (runaway steps of hundreds of lr). The lookup below stays the plain
nearest code; the floor is one ``max(code, x > 0)`` after it, in the reference and the Triton kernel alike.

Stored codes are indices into the *sorted* table (not the bit patterns above): code ``c`` decodes to ``table[c]``.

Nearest-code lookup: the code of a normalised value ``n`` is the number of table midpoints strictly below ``n``
(what ``torch.searchsorted(midpoints, n)`` returns). Binary search costs ~0.5 s per 20M values on a CPU, so both the
reference and the Triton kernel compute the same count with two table reads: ``n``'s fp32 bits map monotonically to an
integer key, ``key >> shift`` picks a bucket holding at most one midpoint (checked when the tables are built),
``lut[bucket]`` is the count of midpoints below the bucket, and one comparison against the next midpoint finishes
it. The result is bit-identical to ``searchsorted``
(tested).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

FORMATS = ("int8", "dynamic", "dynamic_unsigned", "fp8_e4m3")
DYNAMIC_FORMATS = ("dynamic", "dynamic_unsigned")

# Host constants rounded to fp32 once, so every implementation multiplies by the very same value.
INT8_INV_MAX = float(torch.tensor(1.0 / 127.0, dtype=torch.float32).item())
FP8_INV_MAX = float(torch.tensor(1.0 / 448.0, dtype=torch.float32).item())
FP8_MAX = 448.0


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; expected one of {FORMATS}")
    if fmt == "fp8_e4m3" and not hasattr(torch, "float8_e4m3fn"):
        raise ValueError("fmt='fp8_e4m3' needs torch.float8_e4m3fn (torch >= 2.1); use 'int8' or 'dynamic'")


def dynamic_tree_values(signed: bool) -> list[float]:
    """The 256 values of the dynamic-tree map, in code-bit order (float64, unsorted)."""
    magnitude_bits = 7 if signed else 8
    values: list[float] = []
    for sign in (1.0, -1.0) if signed else (1.0,):
        for code in range(2**magnitude_bits):
            if code == 0:
                values.append(0.0 * sign)
                continue
            exponent = magnitude_bits - code.bit_length()  # leading zero bits
            fraction_bits = code.bit_length() - 1  # bits after the indicator
            fraction = code - (1 << fraction_bits)
            step = (fraction + 1) / 2**fraction_bits  # in (0, 1], the top step is exactly 1
            values.append(sign * 10.0**-exponent * (0.1 + 0.9 * step))
    assert len(values) == 256
    return values


def float_key(bits: torch.Tensor) -> torch.Tensor:
    """int32 fp32-bit patterns -> int32 keys with the same order as the float values (-0.0 just below +0.0)."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@dataclass(frozen=True)
class DynamicTables:
    values: torch.Tensor  # (256,) fp32, sorted: code c decodes to values[c]
    midpoints: torch.Tensor  # (256,) fp32: midpoints[i] between values[i] and values[i+1]; midpoints[255] = +inf
    lut: torch.Tensor  # (lut_len,) uint8: count of midpoints below each key bucket
    shift: int  # bucket = (key >> shift) - key_lo
    key_lo: int  # bucket index offset (key of the first bucket >> shift)


@functools.cache
def _dynamic_tables_cpu(fmt: str) -> DynamicTables:
    vals64 = torch.tensor(sorted(dynamic_tree_values(fmt == "dynamic")), dtype=torch.float64)
    values = vals64.to(torch.float32)
    mids = ((values[:-1].double() + values[1:].double()) / 2).to(torch.float32)
    assert bool((mids[1:] > mids[:-1]).all()), "midpoints must be strictly increasing"
    midpoints = torch.cat([mids, torch.tensor([float("inf")])])
    mid_keys = float_key(mids.view(torch.int32)).long()
    # Normalised values lie in [-1, 1]; keys of that range, bucketed by the largest shift that keeps <= 1 midpoint
    # in each bucket.
    key_min = int(float_key(torch.tensor([-1.0]).view(torch.int32)).item())
    key_max = int(float_key(torch.tensor([1.0]).view(torch.int32)).item())
    for shift in range(23, 0, -1):
        if bool((torch.unique_consecutive(mid_keys >> shift, return_counts=True)[1] <= 1).all()):
            break
    key_lo, key_hi = key_min >> shift, key_max >> shift
    bucket_lo_keys = torch.arange(key_lo, key_hi + 1, dtype=torch.int64) << shift
    # back from key to float: the key map is an involution on the int32 bits
    bucket_lo = float_key(bucket_lo_keys.to(torch.int32)).view(torch.float32)
    lut = torch.searchsorted(mids, bucket_lo).to(torch.uint8)
    return DynamicTables(values, midpoints, lut, shift, key_lo)


_device_cache: dict[tuple[str, str], DynamicTables] = {}


def dynamic_tables(fmt: str, device: torch.device | str = "cpu") -> DynamicTables:
    """The tables of a dynamic format on ``device`` (cached per device)."""
    if fmt not in DYNAMIC_FORMATS:
        raise ValueError(f"{fmt!r} has no code table; expected one of {DYNAMIC_FORMATS}")
    device = torch.device(device)
    key = (fmt, str(device))
    tables = _device_cache.get(key)
    if tables is None:
        cpu = _dynamic_tables_cpu(fmt)
        tables = DynamicTables(
            cpu.values.to(device), cpu.midpoints.to(device), cpu.lut.to(device), cpu.shift, cpu.key_lo
        )
        _device_cache[key] = tables
    return tables


def nearest_code(n: torch.Tensor, tables: DynamicTables) -> torch.Tensor:
    """uint8 code of each fp32 ``n`` in [-1, 1]: the number of midpoints strictly below it (torch reference)."""
    flat = n.reshape(-1)  # 1-D index_select: ~4x faster on CPU than advanced indexing (tensor[idx])
    key = float_key(flat.view(torch.int32))
    bucket = ((key >> tables.shift) - tables.key_lo).clamp_(0, tables.lut.numel() - 1)
    base = torch.index_select(tables.lut, 0, bucket)
    nxt = torch.index_select(tables.midpoints, 0, base.int())
    return base.add_((nxt < flat).view(torch.uint8)).view(n.shape)
