#!/usr/bin/env bash
# import-linter walks a package's folder on disk and does not follow setuptools' package-dir mapping, so we
# assemble the ragged_optim tree as a regular install would lay it out, then check the layers contract on it.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="${1:-$root/.venv/bin/python}"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
cp -r "$root/ragged_optim" "$tree/ragged_optim"
for layer in sharding comm kernels; do cp -r "$root/$layer" "$tree/ragged_optim/$layer"; done
cd "$tree"
PYTHONPATH="$tree" "$(dirname "$py")/lint-imports" --config "$root/pyproject.toml"
