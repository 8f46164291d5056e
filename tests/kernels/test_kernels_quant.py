"""Block-wise quantization, torch reference: code tables, nearest-code lookup, error bounds, round trips, edges."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ragged_optim.kernels import FORMATS, code_dtype, dequantize_blockwise, dynamic_tables, quantize_blockwise
from ragged_optim.kernels.qmaps import dynamic_tree_values, nearest_code

DYN = ("dynamic", "dynamic_unsigned")


def _data(n: int, seed: int, dtype=torch.float32, signed=True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # a spread of magnitudes inside each block, like optimizer state
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
    if not signed:
        x = x.abs()
    return x.clamp(-1e4, 1e4).to(dtype)


def _blocks(x: torch.Tensor, bs: int) -> torch.Tensor:
    """Per-element absmax of its block."""
    x = x.float()
    n = x.numel()
    pad = torch.zeros(-(-n // bs) * bs)
    pad[:n] = x.abs()
    return pad.view(-1, bs).amax(1).repeat_interleave(bs)[:n]


# ---- tables -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", DYN)
def test_tables_shape_and_anchors(fmt):
    t = dynamic_tables(fmt)
    v = t.values
    assert v.shape == (256,) and v.dtype == torch.float32
    assert bool((v[1:] >= v[:-1]).all())
    assert v.max().item() == 1.0 and (v == 0).any()
    if fmt == "dynamic":
        assert v.min().item() == -1.0
        pos = v[v > 0]
        assert torch.equal(pos, -v[v < 0].flip(0))  # symmetric
        assert pos.numel() == 127 and math.isclose(pos.min().item(), 1e-6, rel_tol=1e-6)
    else:
        assert v.min().item() == 0.0 and (v > 0).sum().item() == 255
        assert math.isclose(v[1].item(), 1e-7, rel_tol=1e-6)


def test_dynamic_tree_definition():
    # signed: code 0b0_1_xxxxxx is exponent 0 with 6 fraction bits; top fraction is exactly 1.0
    vals = dynamic_tree_values(signed=True)
    assert vals[0b0111_1111] == 1.0 and vals[0b0100_0000] == pytest.approx(0.1 + 0.9 / 64)
    assert vals[0b0000_0001] == pytest.approx(1e-6)  # six leading zeros, indicator, no fraction bits
    assert vals[0b1111_1111] == -1.0 and vals[0] == 0.0
    u = dynamic_tree_values(signed=False)
    assert u[0xFF] == 1.0 and u[0x80] == pytest.approx(0.1 + 0.9 / 128) and u[1] == pytest.approx(1e-7)
    # each decade holds 2**F evenly spaced values
    e1 = sorted(x for x in u if 0.01 < x <= 0.1 + 1e-12)
    gaps = [b - a for a, b in zip(e1, e1[1:])]
    assert len(e1) == 64 and max(gaps) == pytest.approx(0.1 * 0.9 / 64) and min(gaps) == pytest.approx(0.1 * 0.9 / 64)


@pytest.mark.parametrize("fmt", DYN)
def test_nearest_code_matches_searchsorted(fmt):
    t = dynamic_tables(fmt)
    mids = t.midpoints[:-1]
    g = torch.Generator().manual_seed(1)
    lo = -1.0 if fmt == "dynamic" else 0.0
    n = torch.cat(
        [
            torch.rand(200_000, generator=g) * (1 - lo) + lo,
            torch.exp(-torch.rand(200_000, generator=g) * 40) * (torch.randint(0, 2, (200_000,), generator=g) - lo),
            mids,
            torch.nextafter(mids, torch.tensor(2.0)),
            torch.nextafter(mids, torch.tensor(-2.0)),
            t.values,
            torch.tensor([0.0, -0.0, 1.0, 1e-45, -1e-45]),
        ]
    ).clamp(lo, 1.0)
    if fmt == "dynamic":
        n = torch.cat([n, -n])
    assert torch.equal(nearest_code(n, t).long(), torch.searchsorted(mids, n))


# ---- quantize / dequantize ----------------------------------------------------------------------------------------


def _check_bounds(x: torch.Tensor, y: torch.Tensor, bs: int, fmt: str) -> None:
    xf = x.float()
    amax = _blocks(xf, bs)
    err = (xf - y).abs()
    slack = amax * 2e-7 + 1e-30
    if fmt == "int8":
        assert bool((err <= amax / 254 + slack).all()), (err - amax / 254).max()
    elif fmt == "fp8_e4m3":
        # 3 mantissa bits: half an ulp is 2**-4 relative; subnormal spacing is 2**-9 * scale
        assert bool((err <= torch.maximum(xf.abs() * 2**-4, amax / 448 * 2**-10) + slack).all())
    else:
        t = dynamic_tables(fmt).values.double()
        nrm = (xf.double() / torch.where(amax > 0, amax, 1).double()).clamp(t[0].item(), 1.0)
        # the chosen value is a nearest table value: its distance is the smallest distance to the table
        best = (nrm[:, None] - t[None, :]).abs().amin(1)
        got = (y.double() / torch.where(amax > 0, amax, 1).double() - nrm).abs()
        assert bool((got <= best + 1e-6).all())
        half_gap = (t[1:] - t[:-1]).max().item() / 2
        if fmt == "dynamic":
            assert bool((err <= amax * half_gap * (1 + 1e-5) + slack).all())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bs", [1, 7, 64, 256])
def test_round_trip_bounds(fmt, bs):
    x = _data(3 * bs + bs // 2 + 1, seed=bs, signed=fmt != "dynamic_unsigned")
    codes, scales = quantize_blockwise(x, bs, fmt)
    assert codes.dtype == code_dtype(fmt) and codes.shape == (x.numel(),)
    assert scales.dtype == torch.float32 and scales.numel() == -(-x.numel() // bs)
    y = dequantize_blockwise(codes, scales, bs, fmt)
    assert y.dtype == torch.float32 and y.shape == x.shape
    _check_bounds(x, y, bs, fmt)
    # the absmax element of each block survives: exactly for the dynamic maps (scale = absmax, code 1.0); for int8
    # the scale absmax * fp32(1/127) and the product code * scale are two correctly rounded fp32 ops (IEEE on any
    # CPU): within a few float32 ulps, not a tuned tolerance
    ulps = 4 * torch.finfo(torch.float32).eps
    if fmt in ("int8",) + DYN:
        amax = _blocks(x, bs)
        at = x.abs() == amax
        assert torch.allclose(y[at].abs(), amax[at], rtol=0 if fmt in DYN else ulps, atol=0)
    # quantize(dequantize(q)) is a fixed point (exactly for the dynamic maps, whose scale is the absmax itself;
    # int8/fp8 scales are absmax * fp32(1/qmax) and may move by an ulp)
    c2, s2 = quantize_blockwise(y, bs, fmt)
    y2 = dequantize_blockwise(c2, s2, bs, fmt)
    assert torch.equal(y2, y) if fmt in DYN else torch.allclose(y2, y, rtol=ulps, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_blocks_and_short_tail(fmt):
    bs = 32
    x = _data(5 * bs + 3, seed=3, signed=fmt != "dynamic_unsigned")
    x[bs : 2 * bs] = 0  # a zero block
    x[-3:] = 0  # a zero short tail
    codes, scales = quantize_blockwise(x, bs, fmt)
    assert scales[1].item() == 0.0 and scales[-1].item() == 0.0
    y = dequantize_blockwise(codes, scales, bs, fmt)
    assert not y.isnan().any()
    assert bool((y[bs : 2 * bs] == 0).all()) and bool((y[-3:] == 0).all())
    # a short tail is its own block: its scale comes from its own elements
    x[-3:] = torch.tensor([0.5, -0.25, 0.125])
    codes, scales = quantize_blockwise(x, bs, fmt)
    if fmt != "dynamic_unsigned":
        assert scales[-1].item() == pytest.approx(0.5 * {"int8": 1 / 127, "fp8_e4m3": 1 / 448}.get(fmt, 1.0))
    # blocks are independent: quantizing the tail alone gives the same codes and scale
    c_tail, s_tail = quantize_blockwise(x[-3:].clone(), bs, fmt)
    assert torch.equal(c_tail, codes[-3:]) and torch.equal(s_tail, scales[-1:])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_input(fmt, dtype):
    x = _data(1000, seed=5, dtype=dtype, signed=fmt != "dynamic_unsigned")
    codes, scales = quantize_blockwise(x, 128, fmt)
    ref_codes, ref_scales = quantize_blockwise(x.float(), 128, fmt)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    out = dequantize_blockwise(codes, scales, 128, fmt, dtype=dtype)
    assert out.dtype == dtype
    assert torch.equal(out, dequantize_blockwise(codes, scales, 128, fmt).to(dtype))


def test_fp8_codes_are_torch_float8_bits():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8_e4m3fn")
    x = _data(512, seed=7)
    codes, scales = quantize_blockwise(x, 64, "fp8_e4m3")
    y = (x.view(-1, 64) / scales[:, None]).clamp(-448, 448)
    assert torch.equal(codes.view(torch.float8_e4m3fn).view(-1, 64), y.to(torch.float8_e4m3fn))
    assert not codes.view(torch.float8_e4m3fn).float().isnan().any()


def test_in_place_outputs_and_numel():
    x = _data(300, seed=9)
    codes = torch.empty(300, dtype=torch.uint8)
    scales = torch.empty(3, dtype=torch.float32)
    c, s = quantize_blockwise(x, 100, "dynamic", codes=codes, scales=scales)
    assert c is codes and s is scales
    out = torch.empty(300)
    assert dequantize_blockwise(codes, scales, 100, "dynamic", 300, out) is out
    # a shorter numel reads a prefix (its blocks' scales only)
    part = dequantize_blockwise(codes[:150], scales[:2], 100, "dynamic", 150)
    assert torch.equal(part, out[:150])


def test_bad_input_messages():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="unknown quantization format"):
        quantize_blockwise(x, 4, "int4")
    with pytest.raises(ValueError, match="block_size"):
        quantize_blockwise(x, 0, "int8")
    with pytest.raises(ValueError, match="contiguous"):
        quantize_blockwise(torch.randn(4, 4).t(), 4, "int8")
    with pytest.raises(ValueError, match="scales"):
        dequantize_blockwise(torch.zeros(10, dtype=torch.uint8), torch.zeros(2), 4, "dynamic")
    with pytest.raises(ValueError, match="codes"):
        dequantize_blockwise(torch.zeros(10, dtype=torch.uint8), torch.zeros(3), 4, "int8")
    with pytest.raises(ValueError, match="impl"):
        quantize_blockwise(x, 4, "int8", impl="cuda")


def test_empty():
    for fmt in FORMATS:
        c, s = quantize_blockwise(torch.empty(0), 8, fmt)
        assert c.numel() == 0 and s.numel() == 0
        assert dequantize_blockwise(c, s, 8, fmt).numel() == 0


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 700),
    bs=st.integers(1, 300),
    fmt=st.sampled_from(FORMATS),
    seed=st.integers(0, 2**16),
    zero_frac=st.sampled_from([0.0, 0.3]),
)
def test_hypothesis_round_trip(n, bs, fmt, seed, zero_frac):
    x = _data(n, seed, signed=fmt != "dynamic_unsigned")
    if zero_frac:
        x[torch.rand(n, generator=torch.Generator().manual_seed(seed)) < zero_frac] = 0
    codes, scales = quantize_blockwise(x, bs, fmt)
    y = dequantize_blockwise(codes, scales, bs, fmt)
    assert not y.isnan().any()
    _check_bounds(x, y, bs, fmt)
    # block independence: any run of whole blocks quantizes to the same codes on its own
    k = n // bs // 2
    if k:
        c2, s2 = quantize_blockwise(x[k * bs :].clone(), bs, fmt)
        assert torch.equal(c2, codes[k * bs :]) and torch.equal(s2, scales[k:])
