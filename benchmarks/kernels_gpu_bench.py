"""Time the kernels layer on one CUDA GPU; prints one JSON line (run by benchmarks/gpu_check.sh).

Measured in one process against peers in the same run: the Triton fused 8-bit AdamW vs the torch reference on the
same GPU, torchao's and bitsandbytes' 8-bit AdamW where importable, and fused fp32 torch.optim.AdamW; block
quantize/dequantize Triton vs reference. Also checks Triton == reference bit for bit at full size.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _timeit(fn, warmup: int = 3, iters: int = 20) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters  # ms


def _unavailable(e: BaseException) -> str:
    return f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _state_args(s: dict) -> tuple:
    return s["m_codes"], s["m_scales"], s["v_codes"], s["v_scales"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=64 * 2**20)
    ap.add_argument("--block-size", type=int, default=256)
    args = ap.parse_args()

    import torch

    out: dict = {"ok": False}
    if not torch.cuda.is_available():
        out["error"] = "no CUDA device visible to torch"
        print(json.dumps(out))
        return 2
    import triton

    from ragged_optim.kernels import adamw8bit_step, dequantize_blockwise, init_adamw8bit_state, quantize_blockwise

    dev = torch.device("cuda")
    n, bs = args.numel, args.block_size
    out.update(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        numel=n,
        block_size=bs,
    )
    gen = torch.Generator(device=dev).manual_seed(0)
    p0 = torch.randn(n, device=dev, generator=gen)
    grad = torch.randn(n, device=dev, generator=gen) * 1e-2
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, block_size=bs)

    # --- exactness at full size (3 steps) ----------------------------------------------------------------------
    runs = {}
    for impl in ("triton", "torch"):
        p = p0.clone()
        s = init_adamw8bit_state(n, bs, dev)
        for step in (1, 2, 3):
            adamw8bit_step(p, grad, *_state_args(s), step=step, impl=impl, **hp)
        runs[impl] = (p, s)
    (pt, st), (pr, sr) = runs["triton"], runs["torch"]
    out["adamw8bit_exact"] = bool(torch.equal(pt, pr) and all(torch.equal(st[k], sr[k]) for k in st))
    if not out["adamw8bit_exact"]:
        out["adamw8bit_param_mismatches"] = int((pt != pr).sum())
        out["adamw8bit_max_abs_diff"] = float((pt - pr).abs().max())
    qexact = {}
    for fmt in ("int8", "dynamic", "dynamic_unsigned", "fp8_e4m3"):
        x = p0.abs() if fmt == "dynamic_unsigned" else p0
        ct, stt = quantize_blockwise(x, bs, fmt, impl="triton")
        cr, sr_ = quantize_blockwise(x, bs, fmt, impl="torch")
        yt = dequantize_blockwise(ct, stt, bs, fmt, impl="triton")
        yr = dequantize_blockwise(ct, stt, bs, fmt, impl="torch")
        qexact[fmt] = bool(torch.equal(ct, cr) and torch.equal(stt, sr_) and torch.equal(yt, yr))
    out["quant_exact"] = qexact
    del runs, pt, pr, st, sr

    # --- timings -------------------------------------------------------------------------------------------------
    ms: dict = {}
    for impl in ("triton", "torch"):
        p = p0.clone()
        s = init_adamw8bit_state(n, bs, dev)
        step = [0]

        def one(p=p, s=s, impl=impl, step=step):
            step[0] += 1
            adamw8bit_step(p, grad, *_state_args(s), step=step[0], impl=impl, **hp)

        ms[f"adamw8bit_{impl}"] = _timeit(one)
        del p, s

    def torch_optimizer(make):
        w = torch.nn.Parameter(p0.clone())
        w.grad = grad.clone()
        opt = make([w])
        return _timeit(opt.step)

    try:
        ms["torch_adamw_fp32_fused"] = torch_optimizer(
            lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True)
        )
    except Exception as e:  # noqa: BLE001
        ms["torch_adamw_fp32_fused"] = _unavailable(e)
    try:
        from torchao.optim import AdamW8bit as AoAdamW8bit

        ms["torchao_adamw8bit"] = torch_optimizer(lambda ps: AoAdamW8bit(ps, lr=1e-3, weight_decay=0.01, block_size=bs))
    except Exception as e:  # noqa: BLE001
        ms["torchao_adamw8bit"] = _unavailable(e)
    try:
        import bitsandbytes as bnb

        ms["bnb_adamw8bit"] = torch_optimizer(
            lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3, weight_decay=0.01, min_8bit_size=0)
        )
    except Exception as e:  # noqa: BLE001
        ms["bnb_adamw8bit"] = _unavailable(e)

    buf = torch.empty(n, device=dev)
    for fmt in ("int8", "dynamic", "fp8_e4m3"):
        for impl in ("triton", "torch"):
            codes, scales = quantize_blockwise(p0, bs, fmt, impl=impl)
            ms[f"quantize_{fmt}_{impl}"] = _timeit(lambda f=fmt, i=impl: quantize_blockwise(p0, bs, f, impl=i))
            ms[f"dequantize_{fmt}_{impl}"] = _timeit(
                lambda c=codes, s=scales, f=fmt, i=impl, o=buf: dequantize_blockwise(c, s, bs, f, out=o, impl=i)
            )

    out["ms"] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in ms.items()}
    base = ms["adamw8bit_triton"]
    out["speedup_of_triton_adamw8bit"] = {
        k: round(v / base, 3) for k, v in ms.items() if isinstance(v, float) and not k.startswith(("quant", "dequant"))
    }
    # bytes the fused step must move: p r+w (8), g r (4), two code arrays r+w (4), scales (negligible)
    out["adamw8bit_triton_GBps"] = round(16 * n / (base * 1e-3) / 1e9, 1)
    out["ok"] = out["adamw8bit_exact"] and all(qexact.values())
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    t0 = time.time()
    try:
        rc = main()
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}))
        rc = 1
    print(f"[kernels_gpu_bench] {time.time() - t0:.1f}s", file=sys.stderr)
    sys.exit(rc)
