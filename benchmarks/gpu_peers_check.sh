#!/usr/bin/env bash
# Issue 18's Muon key on one CUDA machine, in one call (about 2-5 minutes): `bench peers --device cuda --families
# muon --json` (ro.Muon, torch.optim.Muon + AdamW, Keller Jordan's muon-optimizer; 3 seeds x 300 steps).
#
# The device machines reach no package index, so the one peer that is not torch comes as a wheel folder made
# beforehand on a machine that does (it is ignored by git; name it in the device call's `carry`):
#     pip download --no-deps muon-optimizer -d .whl
# Then, on the GPU machine: bash benchmarks/gpu_peers_check.sh [WHEEL_DIR (default .whl)] [extra bench args]
# Uses the machine's own CUDA torch (never installs one); our package goes on the path as a tree of links.
# Prints the bench's JSON on stdout (its last line); progress on stderr. Exit 2 at once without a CUDA device.
set -uo pipefail
cd "$(dirname "$0")/.."
wheels="${1:-.whl}"
shift || true
py="${PYTHON:-python3}"
log() { echo "[gpu_peers_check] ${SECONDS}s: $*" >&2; }

"$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null || {
  echo '{"ok": false, "error": "no CUDA device visible to torch on this machine"}'
  exit 2
}
site="$(mktemp -d)"
if ls "$wheels"/*.whl >/dev/null 2>&1; then
  "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps --target "$site" "$wheels"/*.whl 1>&2 ||
    log "installing the wheels of $wheels failed: their rows will say why"
else
  log "no wheels in $wheels: muon-optimizer's row will say it is missing"
fi
# The package maps repo-root folders into ragged_optim.* (pyproject's package-dir): the same tree, of links.
mkdir -p "$site/ragged_optim"
for f in ragged_optim/*; do ln -s "$PWD/$f" "$site/ragged_optim/"; done
for layer in sharding comm kernels; do ln -s "$PWD/$layer" "$site/ragged_optim/$layer"; done
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
"$py" -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())' >&2
log "bench peers --device cuda --families muon"
cd "$site" # (from the repo root, its own ragged_optim/ would be imported, without the layers)
"$py" -m ragged_optim bench peers --device cuda --families muon --json "$@"
