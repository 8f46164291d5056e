"""Triton kernels bit-exact against the torch reference.

With a CUDA GPU the kernels run compiled on CUDA tensors. Without one, this module re-runs itself in a child
process with TRITON_INTERPRET=1 (it must be set before triton is first imported, and the rest of the suite must
not be affected), on small CPU tensors.
"""

import os
import subprocess
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

if not CUDA and not INTERPRET:

    def test_triton_kernels_under_interpreter():
        pytest.importorskip("triton")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", __file__]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, (r.stdout[-8000:], r.stderr[-4000:])

    def _compile_ptx(fn, sig: dict, consts: dict) -> str:
        """PTX of a kernel compiled for sm_90 with our launch options (no GPU needed: LLVM + bundled ptxas)."""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from ragged_optim.kernels.quant_triton import LAUNCH_OPTS

        full = {k: sig.get(k, "constexpr") for k in fn.arg_names}
        try:
            src = ASTSource(fn=fn, signature=full, constexprs=consts)
            return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(LAUNCH_OPTS)).asm["ptx"]
        except (TypeError, AttributeError, ImportError) as e:  # another triton's compile API
            pytest.skip(f"cannot drive triton.compile here: {e}")

    def test_compiled_ptx_is_ieee():
        """What the interpreter cannot show: on sm_90 the kernels compile to correctly rounded div/sqrt, with no
        fma contraction (Triton 3.9's default would fuse 64 mul+add pairs in the AdamW kernel), no flush-to-zero
        and no approximate instructions."""
        pytest.importorskip("triton")
        from ragged_optim.kernels.adamw8bit_triton import _adamw8bit_kernel
        from ragged_optim.kernels.qmaps import dynamic_tables
        from ragged_optim.kernels.quant_triton import _dequantize_kernel, _quantize_kernel

        s, u = dynamic_tables("dynamic"), dynamic_tables("dynamic_unsigned")
        ints = {"numel": "i32", "num_blocks": "i32", "BS": "i32"}
        sig = {k: "*fp32" for k in ("p_ptr", "g_ptr", "ms_ptr", "vs_ptr", "s_vals", "s_mids", "u_vals", "u_mids")}
        sig.update({k: "*u8" for k in ("mc_ptr", "vc_ptr", "s_lut", "u_lut")}, **ints)
        consts = ("decay", "b1", "c1", "b2", "c2", "inv_sqrt_bc2", "eps", "step_size", "m_bound")
        sig.update({k: "fp32" for k in consts})
        tables = dict(S_SHIFT=s.shift, S_KEY_LO=s.key_lo, S_LUT_LEN=s.lut.numel())
        tables.update(U_SHIFT=u.shift, U_KEY_LO=u.key_lo, U_LUT_LEN=u.lut.numel())
        ptx = {"adamw8bit": _compile_ptx(_adamw8bit_kernel, sig, dict(ROWS=8, COLS=256, **tables))}
        bf16_sig = {**sig, "p_ptr": "*bf16", "g_ptr": "*bf16"}  # a bf16 param (rounded by integer ops)
        ptx["adamw8bit_bf16_param"] = _compile_ptx(_adamw8bit_kernel, bf16_sig, dict(ROWS=8, COLS=256, **tables))
        qsig = {"x_ptr": "*bf16", "scales_ptr": "*fp32", "mids_ptr": "*fp32", "lut_ptr": "*u8", **ints}
        for name, fmt, codes in (("int8", 0, "*i8"), ("fp8", 3, "*u8")):
            consts = dict(ROWS=8, COLS=128, FMT=fmt, SHIFT=0, KEY_LO=0, LUT_LEN=1)
            ptx[f"quantize_{name}"] = _compile_ptx(_quantize_kernel, {**qsig, "codes_ptr": codes}, consts)
        dsig = {"codes_ptr": "*u8", "scales_ptr": "*fp32", "out_ptr": "*i16", "vals_ptr": "*fp32", **ints}
        ptx["dequantize_fp8_bf16"] = _compile_ptx(
            _dequantize_kernel, dsig, dict(ROWS=8, COLS=128, FMT=3, OUT_BF16=True)
        )
        for name, text in ptx.items():
            for bad in ("fma.", ".ftz", "approx", "div.full"):
                assert bad not in text, (name, bad)
        for name in ("adamw8bit", "adamw8bit_bf16_param"):
            assert "div.rn.f32" in ptx[name] and "sqrt.rn.f32" in ptx[name], name
        assert "div.rn.f32" in ptx["quantize_int8"] and "div.rn.f32" in ptx["quantize_fp8"]

else:
    import triton  # noqa: F401
    import triton.language as tl
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ragged_optim.kernels import (
        FORMATS,
        adamw8bit_step,
        dequantize_blockwise,
        init_adamw8bit_state,
        quantize_blockwise,
    )
    from ragged_optim.kernels.quant_triton import fp8e4m3_decode, fp8e4m3_encode, to_bf16_rtne

    DEV = "cuda" if CUDA and not INTERPRET else "cpu"
    # interpreted programs cost ~1 ms each: keep the interpreter to a few tiles, use real sizes on a GPU
    SCALE = 1 if DEV == "cpu" else 64
    # on a GPU each new tile width (next_pow2(block_size)) compiles new kernels: there, hypothesis draws block sizes
    # the fixed tests already compiled and varies sizes and data; odd block sizes run under the interpreter
    EXAMPLES = 60 if DEV == "cpu" else 30
    BLOCK_SIZES = st.integers(1, 300) if DEV == "cpu" else st.sampled_from([32, 100, 256])
    ADAM_BLOCK_SIZES = st.integers(1, 300) if DEV == "cpu" else st.sampled_from([64, 100, 256])

    def _data(n, seed, dtype=torch.float32, signed=True):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
        x = x.clamp(-1e4, 1e4)
        return (x if signed else x.abs()).to(dtype).to(DEV)

    def _quant_both(x, bs, fmt):
        c1, s1 = quantize_blockwise(x, bs, fmt, impl="triton")
        c2, s2 = quantize_blockwise(x, bs, fmt, impl="torch")
        assert torch.equal(c1, c2), (c1 != c2).nonzero()[:10]
        assert torch.equal(s1, s2)
        for dt in (torch.float32, torch.bfloat16):
            y1 = dequantize_blockwise(c1, s1, bs, fmt, dtype=dt, impl="triton")
            y2 = dequantize_blockwise(c1, s1, bs, fmt, dtype=dt, impl="torch")
            assert torch.equal(y1, y2)

    @pytest.mark.parametrize("fmt", FORMATS)
    @pytest.mark.parametrize("bs", [32, 100, 256])
    def test_quantize_exact(fmt, bs):
        n = (3 * bs + bs // 3 + 1) * SCALE
        x = _data(n, bs, signed=fmt != "dynamic_unsigned")
        x[:bs] = 0  # zero block
        _quant_both(x, bs, fmt)
        _quant_both(x.bfloat16(), bs, fmt)

    @pytest.mark.parametrize("fmt", FORMATS)
    def test_quantize_exact_subnormal(fmt):
        """Subnormal inputs and scales: nothing may flush to zero (kernels launch with enable_reflect_ftz=False)."""
        bs = 64
        x = _data(4 * bs * SCALE, 11, signed=fmt != "dynamic_unsigned")
        x[:bs] = x[:bs] * 1e-40  # a whole block of subnormals
        x[bs : 2 * bs : 3] = x[bs : 2 * bs : 3] * 1e-42  # subnormals next to normals
        x[2 * bs : 3 * bs] = x[2 * bs : 3 * bs] * 1e-36  # x/absmax normal, absmax*(1/qmax) subnormal
        _quant_both(x, bs, fmt)

    @settings(max_examples=EXAMPLES, deadline=None)
    @given(n=st.integers(1, 600), bs=BLOCK_SIZES, fmt=st.sampled_from(FORMATS), seed=st.integers(0, 2**16))
    def test_quantize_exact_hypothesis(n, bs, fmt, seed):
        _quant_both(_data(n * SCALE, seed, signed=fmt != "dynamic_unsigned"), bs, fmt)

    @pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="no float8_e4m3fn")
    def test_fp8_encode_decode_every_boundary():
        """The integer fp8 e4m3 encoder rounds like torch's cast on every code, midpoint (ties to even) and its
        neighbours, subnormals and zero included; the decoder inverts every non-NaN code."""

        @triton.jit
        def _roundtrip(y_ptr, code_ptr, back_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            c = fp8e4m3_encode(tl.load(y_ptr + offs, mask=mask, other=0.0))
            tl.store(code_ptr + offs, c, mask=mask)
            tl.store(back_ptr + offs, fp8e4m3_decode(c), mask=mask)

        codes = torch.arange(256, dtype=torch.int32)
        codes = codes[(codes & 0x7F) != 0x7F]  # drop NaNs
        vals = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
        pos = vals[vals >= 0].unique()
        mids = (pos[1:] + pos[:-1]) / 2  # exact in fp32
        up, down = torch.tensor(1e9), torch.tensor(-1e9)
        y = torch.cat([vals, mids, torch.nextafter(mids, up), torch.nextafter(mids, down), torch.rand(2000) * 448])
        y = torch.cat([y, -y, torch.tensor([0.0, -0.0, 1e-30, -1e-30, 448.0, -448.0])]).clamp(-448, 448)
        y = y.contiguous().to(DEV)
        out = torch.empty(y.numel(), dtype=torch.int32, device=DEV)
        back = torch.empty(y.numel(), device=DEV)
        _roundtrip[(triton.cdiv(y.numel(), 1024),)](y, out, back, y.numel(), BLOCK=1024, enable_fp_fusion=False)
        want = y.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
        assert torch.equal(out, want), y[out != want][:10]
        assert torch.equal(back, want.to(torch.uint8).view(torch.float8_e4m3fn).float())

    def test_to_bf16_rtne_rounds_like_torch():
        """The kernels' fp32 -> bf16 rounding (integer ties-to-even, since the interpreter truncates) equals torch's
        cast on ties, their neighbours, subnormals, zeros, infinities and the overflow edge."""

        @triton.jit
        def _to_bf16(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(y_ptr + offs, to_bf16_rtne(tl.load(x_ptr + offs, mask=mask, other=0.0)), mask=mask)

        g_ = torch.Generator().manual_seed(3)
        base = torch.randn(3000, generator=g_) * torch.exp(torch.randn(3000, generator=g_) * 10)
        base = torch.cat([base, base * 1e-38, torch.tensor([0.0, -0.0, 3.3895e38, float("inf"), -float("inf")])])
        b = base.bfloat16().float().view(torch.int32)
        ties = (b + 0x8000).view(torch.float32)  # exactly half a bf16 step above: ties, half to an odd bf16 value
        x = torch.cat(
            [base, ties, torch.nextafter(ties, torch.tensor(1e39)), torch.nextafter(ties, -torch.tensor(1e39))]
        )
        x = torch.cat([x, -x, torch.tensor([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max])])
        x = x[torch.isfinite(x) | torch.isinf(x)].contiguous().to(DEV)
        y = torch.empty(x.numel(), dtype=torch.bfloat16, device=DEV)
        _to_bf16[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
        want = x.bfloat16()
        assert torch.equal(y.view(torch.int16), want.view(torch.int16)), x[
            y.view(torch.int16) != want.view(torch.int16)
        ][:8]

    def _adam_both(n, bs, steps, seed, gdtype=torch.float32, wd=0.1, pdtype=torch.float32):
        g_ = torch.Generator().manual_seed(seed)
        p = torch.randn(n, generator=g_).to(pdtype).to(DEV)
        s1 = init_adamw8bit_state(n, bs, DEV)
        s2 = {k: v.clone() for k, v in s1.items()}
        p1, p2 = p.clone(), p.clone()
        for step in range(1, steps + 1):
            g = (torch.randn(n, generator=g_) * torch.exp(torch.randn(n, generator=g_) * 2)).to(gdtype).to(DEV)
            kw = dict(step=step, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=wd, block_size=bs)
            adamw8bit_step(p1, g, s1["m_codes"], s1["m_scales"], s1["v_codes"], s1["v_scales"], impl="triton", **kw)
            adamw8bit_step(p2, g, s2["m_codes"], s2["m_scales"], s2["v_codes"], s2["v_scales"], impl="torch", **kw)
            assert torch.equal(p1, p2), (step, (p1 != p2).sum().item(), (p1 - p2).abs().max().item())
            for k in s1:
                assert torch.equal(s1[k], s2[k]), (step, k, (s1[k] != s2[k]).sum().item())

    @pytest.mark.parametrize("bs", [64, 100, 256])
    def test_adamw8bit_exact(bs):
        _adam_both((4 * bs + bs // 2) * SCALE, bs, steps=3, seed=bs)

    @pytest.mark.parametrize("pdtype", [torch.bfloat16, torch.float16])
    def test_adamw8bit_exact_low_precision_params(pdtype):
        """A bf16/fp16 param: read as fp32, stored rounded to nearest once (the reference's copy_), bit for bit."""
        _adam_both(4 * 128 * SCALE, 128, steps=3, seed=7, gdtype=pdtype, pdtype=pdtype)

    def _both_on(n, bs, seed, steps, grad, **kw):
        """Triton and the reference from the same state, ``grad(step, generator)`` each step: equal bit for bit
        after every step. Returns the final param and state."""
        g_ = torch.Generator().manual_seed(seed)
        p = torch.randn(n, generator=g_).to(DEV)
        s1 = init_adamw8bit_state(n, bs, DEV)
        s2 = {k: v.clone() for k, v in s1.items()}
        p1, p2 = p.clone(), p.clone()
        for step in steps:
            g = grad(step, g_).to(DEV)
            for pp, ss, impl in ((p1, s1, "triton"), (p2, s2, "torch")):
                adamw8bit_step(pp, g, ss["m_codes"], ss["m_scales"], ss["v_codes"], ss["v_scales"], impl=impl,
                               step=step, block_size=bs, **kw)  # fmt: skip
            assert torch.equal(p1, p2) and all(torch.equal(s1[k], s2[k]) for k in s1), step
        return p1, s1

    def test_adamw8bit_exact_subnormal_grads():
        """Tiny grads make v (and sqrt(v), m) subnormal."""
        n = 4 * 64 * SCALE

        def grad(step, g_):
            g = torch.randn(n, generator=g_) * 1e-21
            g[: n // 2] *= 1e-18
            return g

        _both_on(n, 64, 5, (1, 2), grad, lr=1e-2, eps=1e-30)

    def test_adamw8bit_exact_heavy_tailed_grads():
        """Grads spanning 1e-8..1 of their block's largest: the sqrt(v) zero floor (code >= 1 for a positive value)
        runs in both implementations, and zero grads keep code 0."""
        n = 3 * 64 * SCALE

        def grad(step, g_):
            mag = 10.0 ** (-8 * torch.rand(n, generator=g_))
            g = torch.sign(torch.randn(n, generator=g_)) * mag
            g[:: 7 + step] = 0.0
            return g

        _, s1 = _both_on(n, 64, 9, (1, 2, 3), grad, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)
        assert bool((s1["v_codes"] == 0).sum() > 0) and bool((s1["v_codes"] == 1).sum() > 0)

    def test_adamw8bit_exact_overflowing_grads():
        """A grad beyond ~1e19 overflows v: both implementations clamp it to the largest float32 the same way."""
        n = 3 * 64 * SCALE

        def grad(step, g_):
            g = torch.randn(n, generator=g_)
            if step == 1:
                g[5] = 1e30
            g[20:40] = 0.0  # no grad in the spike's block: code 0, which an inf scale made NaN
            return g

        p1, _ = _both_on(n, 64, 11, (1, 2, 3), grad, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)
        assert bool(torch.isfinite(p1).all())

    def test_adamw8bit_exact_bf16_grad_no_wd():
        _adam_both(700 * SCALE, 128, steps=2, seed=1, gdtype=torch.bfloat16, wd=0.0)

    @settings(max_examples=EXAMPLES * 2 // 3, deadline=None)
    @given(n=st.integers(1, 900), bs=ADAM_BLOCK_SIZES, seed=st.integers(0, 2**16))
    def test_adamw8bit_exact_hypothesis(n, bs, seed):
        _adam_both(n * SCALE, bs, steps=2, seed=seed)
