#!/usr/bin/env bash
# GPU check on one CUDA machine (fresh environment, < 9 minutes):
#   1. sets up a venv that sees the system's packages (reuses a CUDA torch if there is one, installs torch only if
#      it is missing), plus test deps and, best effort, torchao and bitsandbytes (never letting them move torch);
#   2. runs tests/kernels/test_kernels_*.py on CUDA: the Triton kernels compiled and compared bit for bit with the torch
#      reference on the GPU;
#   3. times Triton vs the torch reference vs torchao / bitsandbytes 8-bit AdamW (benchmarks/kernels_gpu_bench.py);
#   4. a training step at world size 1 on CUDA with NCCL under torch.cuda.set_sync_debug_mode("error") after
#      warm-up, for every optimizer, and AdamW parity with one process (benchmarks/cuda_step_check.py);
#   5. `bench memory` and `bench fsdp` on CUDA at world size 1 (NCCL), ours against torch FSDP2; `memory_ratios`
#      holds bench memory's peak_ratio_vs_fsdp2_{adamw,muon,adamw_ac} (torch.cuda.max_memory_allocated on CUDA,
#      the same keys the CPU bench computes from its exact allocator count) and init_peak_over_bound.
# Prints one JSON line on stdout; progress goes to stderr. Exit 0 only if the tests pass, Triton == reference at
# full size and the step check passes (timings that a timeout cut short are reported as far as they got).
# Without a GPU it exits 2 at once with {"ok": false, "error": "..."}.
set -uo pipefail
cd "$(dirname "$0")/.."
budget="${RO_GPU_CHECK_BUDGET_S:-520}" # the whole script stays under 9 minutes
left() { echo $((budget - SECONDS)); }
log() { echo "[gpu_check] ${SECONDS}s: $*" >&2; }
fail() { # $1 = message, $2 = exit code
  python3 -c 'import json,sys; print(json.dumps({"ok": False, "error": sys.argv[1]}))' "$1" 2>/dev/null ||
    echo "{\"ok\": false, \"error\": \"$1\"}"
  log "$1"
  exit "${2:-1}"
}

if nvidia-smi -L >/dev/null 2>&1; then
  log "GPU: $(nvidia-smi -L | head -1)"
elif ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
  log "GPU: $(ls /dev/nvidia[0-9]* | head -1) (nvidia-smi unavailable)"
else
  fail "no CUDA GPU on this machine (nvidia-smi lists no device and there is no /dev/nvidia*); run this on a GPU host" 2
fi
command -v python3 >/dev/null 2>&1 || fail "python3 not found" 2

venv="${RO_GPU_VENV:-/tmp/ragged-optim-gpu-venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv --system-site-packages "$venv" || fail "could not create a venv at $venv" 2
  # --system-site-packages sees the base interpreter's packages only; when python3 is itself a venv (GPU images
  # often ship torch that way), a .pth line puts that venv's packages (its CUDA torch) on the path as well.
  outer="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  inner="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  [ -z "$outer" ] || [ "$outer" = "$inner" ] || echo "$outer" >"$inner/_ragged_optim_outer_site.pth"
fi
py="$venv/bin/python"
pipq() { # quiet pip install, never past the budget's share for installs
  local t=$(($(left) - 150))
  [ "$t" -gt 10 ] || { log "no time left to pip install $*"; return 1; }
  timeout "$t" "$py" -m pip install -q --disable-pip-version-check "$@" 1>&2
}

cuda_ok() { "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
if ! "$py" -c 'import torch' >/dev/null 2>&1; then
  log "torch missing: installing it (PyPI's Linux wheel ships CUDA)"
  pipq torch || fail "pip install torch failed" 1
fi
cuda_ok || fail "torch $("$py" -c 'import torch; print(torch.__version__)' 2>&1 | tail -1) sees no CUDA device" 1
"$py" -c 'import triton' >/dev/null 2>&1 || pipq triton || fail "triton missing and pip install triton failed" 1
log "torch $("$py" -c 'import torch, triton; print(torch.__version__, "triton", triton.__version__)')"

"$py" -c 'import pytest, hypothesis, numpy, einops' >/dev/null 2>&1 || pipq pytest hypothesis numpy einops pytest-timeout ||
  fail "pip install of the test dependencies failed" 1
# our package (the repo-root layers map into ragged_optim.*), without touching dependencies; skipped when this
# checkout is already the installed one
"$py" -c 'import os, ragged_optim.kernels as k; assert os.path.samefile(os.path.dirname(k.__file__), "kernels")' \
  >/dev/null 2>&1 || pipq --no-deps -e . || pipq --no-deps --no-build-isolation -e . || fail "pip install -e . failed" 1
# peers, best effort; --no-deps so they cannot replace the CUDA torch (an incompatible one reports itself below)
if [ "$(left)" -gt 200 ]; then
  "$py" -c 'import torchao' >/dev/null 2>&1 || pipq --no-deps torchao || log "torchao: pip install failed"
  "$py" -c 'import bitsandbytes' >/dev/null 2>&1 || pipq --no-deps bitsandbytes || log "bitsandbytes: pip install failed"
else
  log "skipping torchao / bitsandbytes installs: $(left)s left"
fi

log "running tests/kernels/test_kernels_*.py on CUDA"
test_log="$(mktemp)"
t_tests=$(($(left) - 315)) # leave 75 s for the kernel benchmark, 240 s for steps 4-5
[ "$t_tests" -le 150 ] || t_tests=150
timeout "$t_tests" "$py" -m pytest -p no:cacheprovider -rfE tests/kernels/test_kernels_quant.py tests/kernels/test_kernels_adamw8bit.py \
  tests/kernels/test_kernels_triton.py >"$test_log" 2>&1
test_rc=$?
tail -n 30 "$test_log" >&2
test_summary="$(grep -E '(passed|failed|error)' "$test_log" | tail -1)"

log "benchmarking"
t_bench=$(($(left) - 243))
[ "$t_bench" -ge 20 ] || t_bench=20
bench_json="$(timeout "$t_bench" "$py" benchmarks/kernels_gpu_bench.py | tail -1)"
bench_rc=$?
[ -n "$bench_json" ] || bench_json='{"ok": false, "error": "benchmark produced no output"}'
[ "$bench_rc" -ne 124 ] || log "benchmark hit its ${t_bench}s timeout; reporting its last line"

log "training step on CUDA under set_sync_debug_mode(\"error\")"
t_step=$(($(left) - 163))
[ "$t_step" -ge 30 ] || t_step=30
step_json="$(timeout "$t_step" "$py" benchmarks/cuda_step_check.py | tail -1)"
[ -n "$step_json" ] || step_json='{"ok": false, "error": "the step check produced no output (timeout?)"}'

run_bench() { # $1 = name, $2 = seconds: `bench NAME --world-size 1 --device cuda --json`, its last line
  local out
  out="$(timeout "$2" "$py" -m ragged_optim bench "$1" --world-size 1 --device cuda --json | tail -1)"
  [ -n "$out" ] || out="{\"error\": \"bench $1 produced no output within $2 s\"}"
  echo "$out"
}
log "bench memory on CUDA"
mem_json="$(run_bench memory $(($(left) / 2 - 2)))"
log "bench fsdp on CUDA"
fsdp_json="$(run_bench fsdp $(($(left) - 5)))"

"$py" - "$test_rc" "$test_summary" "$bench_json" "$SECONDS" "$step_json" "$mem_json" "$fsdp_json" <<'EOF'
import json, sys
test_rc, summary = int(sys.argv[1]), sys.argv[2]


def parsed(text, what):
    try:
        return json.loads(text)
    except ValueError:
        return {"ok": False, "error": f"unparsable {what} output: " + text[:500]}


bench, step = parsed(sys.argv[3], "benchmark"), parsed(sys.argv[5], "step check")
memory, fsdp = parsed(sys.argv[6], "bench memory"), parsed(sys.argv[7], "bench fsdp")
ok = test_rc == 0 and bool(bench.get("ok")) and bool(step.get("ok"))
# the ratios the CPU bench reports (there from the exact allocator count), here from max_memory_allocated
ratios = {k: v for k, v in memory.items() if k.startswith("peak_ratio_vs_fsdp2_") or k == "init_peak_over_bound"}
print(json.dumps({"ok": ok, "tests": {"rc": test_rc, "summary": summary}, "bench": bench, "step_check": step,
                  "memory_ratios": ratios, "bench_memory": memory, "bench_fsdp": fsdp, "seconds": int(sys.argv[4])}))
sys.exit(0 if ok else 1)
EOF
