"""The train job's default lrs are the lr sweep's best (issue 35): each optimizer `ragged-optim train` offers was
swept (benchmarks/lr_sweep.py, results committed in benchmarks/results/lr_sweep_200steps.json) at >= 4 lrs x 2
seeds, its best mean validation loss is not at an edge of its grid, and OPTIMIZERS' default is that lr. The
README's optimizer table is what `lr_sweep.py --table` prints from the same file. Reads files only (no training)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from ragged_optim.train.optimizers import OPTIMIZERS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "lr_sweep_200steps.json")


def _sweep_module():
    spec = importlib.util.spec_from_file_location("lr_sweep", os.path.join(ROOT, "benchmarks", "lr_sweep.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def result():
    with open(RESULTS) as f:
        return json.load(f)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_default_lr_is_the_sweeps_best_inside_its_grid(result, name):
    runs = [r for r in result["runs"] if r["optimizer"] == name]
    lrs = sorted({r["lr"] for r in runs})
    assert len(lrs) >= 4, f"{name}: swept at {lrs}; the sweep needs >= 4 lrs"
    for lr in lrs:
        seeds = sorted(r["seed"] for r in runs if r["lr"] == lr)
        assert len(seeds) >= 2, f"{name} at lr {lr}: seeds {seeds}; the sweep needs >= 2"
    best = _sweep_module().summarize(result["runs"])[name]["lr"]
    assert lrs[0] < best < lrs[-1], f"{name}: best lr {best} at an edge of {lrs}: extend the grid"
    assert OPTIMIZERS[name].default_lr == best, (
        f"{name}: default lr {OPTIMIZERS[name].default_lr}, the sweep's best {best} (set it in "
        "ragged_optim/train/optimizers.py, or rerun the sweep)"
    )


def test_readme_table_is_the_sweeps(result):
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    table = _sweep_module().markdown_table(result)
    assert table in readme, f"README.md's optimizer table is not lr_sweep.py --table's:\n{table}"
