"""`./dev`, the entry point of a fresh clone: its help names every command, `./dev test FILE -q` shows pytest's
summary line, and `plan` explains its table's columns.

Before: `./dev --help` listed train, plan and bench but not test, and pyproject's addopts already held -q, so
`./dev test FILE -q` ran pytest -qq, which prints no summary line (both checked to fail)."""

import os
import subprocess
import sys

from ragged_optim.plan_cmd import COLUMNS, columns_legend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dev_help_lists_every_command():
    out = subprocess.run(["bash", os.path.join(ROOT, "dev"), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for command in ("train", "plan", "bench"):
        assert command in out.stdout
    assert "\n  test " in out.stdout and "./dev test" in out.stdout


def test_test_command_with_q_prints_the_summary_line():
    # what `./dev test FILE -q` runs (dev execs `python -m pytest "$@"` in the repo root)
    cmd = [sys.executable, "-m", "pytest", "tests/test_train.py::test_lr_schedule", "-q", "-p", "no:cacheprovider"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout.splitlines()[-1], out.stdout


def test_plan_table_explains_its_columns(capsys):
    from ragged_optim.cli import main

    assert main(["plan", "--model", "llama3-8b", "--world-size", "4", "--granularity", "16"]) == 0
    text = capsys.readouterr().out
    assert columns_legend() in text
    header = text.splitlines()[1]
    for name, explanation in COLUMNS:
        assert name in header and explanation in text
