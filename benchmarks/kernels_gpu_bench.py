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

ITERS = 20


def _timeit(fn, warmup: int = 3) -> float:
    import torch

    iters = ITERS
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():  # --device cpu dry run
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters * 1e3
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


def main(out: dict) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=64 * 2**20)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="'cpu' dry-runs the script (small --numel, TRITON_INTERPRET=1)")
    args = ap.parse_args()
    global ITERS
    ITERS = args.iters

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        out["error"] = "no CUDA device visible to torch"
        emit(out)
        return 2
    import triton

    from ragged_optim.kernels import adamw8bit_step, dequantize_blockwise, init_adamw8bit_state, quantize_blockwise

    dev = torch.device(args.device)
    n, bs = args.numel, args.block_size
    out.update(
        device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (dry run)",
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

    out["ok"] = out["adamw8bit_exact"] and all(qexact.values())
    emit(out)

    # --- timings (a JSON line after each part: a timeout still leaves the last one) ------------------------------
    ms: dict = {}
    out["ms"] = ms
    for impl in ("triton", "torch"):
        p = p0.clone()
        s = init_adamw8bit_state(n, bs, dev)
        step = [0]

        def one(p=p, s=s, impl=impl, step=step):
            step[0] += 1
            adamw8bit_step(p, grad, *_state_args(s), step=step[0], impl=impl, **hp)

        ms[f"adamw8bit_{impl}"] = _timeit(one)
        del p, s
    buf = torch.empty(n, device=dev)
    for fmt in ("int8", "dynamic", "fp8_e4m3"):
        for impl in ("triton", "torch"):
            codes, scales = quantize_blockwise(p0, bs, fmt, impl=impl)
            ms[f"quantize_{fmt}_{impl}"] = _timeit(lambda f=fmt, i=impl: quantize_blockwise(p0, bs, f, impl=i))
            ms[f"dequantize_{fmt}_{impl}"] = _timeit(
                lambda c=codes, s=scales, f=fmt, i=impl, o=buf: dequantize_blockwise(c, s, bs, f, out=o, impl=i)
            )
    del buf
    emit(out)

    def torch_optimizer(make):
        w = torch.nn.Parameter(p0.clone())
        w.grad = grad.clone()
        opt = make([w])
        return _timeit(opt.step)

    peers = (
        ("torch_adamw_fp32_fused", lambda: lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True)),
        ("bnb_adamw8bit", _bnb),
        ("torchao_adamw8bit", lambda: _torchao(bs)),  # last: it runs torch.compile on its first steps
    )
    for name, factory in peers:
        ms[name] = "unavailable: timed out"  # what the line says if the timeout kills us inside this peer
        try:
            ms[name] = torch_optimizer(factory())
        except Exception as e:  # noqa: BLE001
            ms[name] = _unavailable(e)
        emit(out)
    return 0 if out["ok"] else 1


def _bnb():
    import bitsandbytes as bnb

    return lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3, weight_decay=0.01, min_8bit_size=0)


def _torchao(bs: int):
    from torchao.optim import AdamW8bit

    return lambda ps: AdamW8bit(ps, lr=1e-3, weight_decay=0.01, block_size=bs)


def emit(out: dict) -> None:
    """Print the results so far as one JSON line, with ratios against the Triton 8-bit AdamW."""
    ms = out.get("ms", {})
    line = dict(out)
    line["ms"] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in ms.items()}
    base = ms.get("adamw8bit_triton")
    if isinstance(base, float):
        line["speedup_of_triton_adamw8bit"] = {
            k: round(v / base, 3)
            for k, v in ms.items()
            if isinstance(v, float) and not k.startswith(("quant", "dequant"))
        }
        # bytes the fused step must move: p r+w (8), g r (4), two code arrays r+w (4); scales are negligible
        line["adamw8bit_triton_GBps"] = round(16 * out["numel"] / (base * 1e-3) / 1e9, 1)
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    t0 = time.time()
    results: dict = {"ok": False}
    try:
        rc = main(results)
    except Exception as e:  # noqa: BLE001
        results["ok"] = False
        results["error"] = f"{type(e).__name__}: {e}"[:2000]
        emit(results)
        rc = 1
    print(f"[kernels_gpu_bench] {time.time() - t0:.1f}s", file=sys.stderr)
    sys.exit(rc)
