"""`./dev`, the entry point of a fresh clone: its help names every command, `./dev test FILE -q` shows pytest's
summary line, and `plan` explains its table's columns.

Before: `./dev --help` listed train, plan and bench but not test, and pyproject's addopts already held -q, so
`./dev test FILE -q` ran pytest -qq, which prints no summary line (both checked to fail)."""

import os
import subprocess
import sys

from ragged_optim.plan_cmd import COLUMNS, columns_legend

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_dev_help_lists_every_command():
    out = subprocess.run(["bash", os.path.join(ROOT, "dev"), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for command in ("train", "plan", "bench"):
        assert command in out.stdout
    assert "\n  test " in out.stdout and "./dev test" in out.stdout


def test_test_command_with_q_prints_the_summary_line():
    # what `./dev test FILE -q` runs (dev execs `python -m pytest "$@"` in the repo root)
    test = "tests/train/test_train.py::test_lr_schedule"
    cmd = [sys.executable, "-m", "pytest", test, "-q", "-p", "no:cacheprovider"]
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


def test_first_setup_says_what_it_installs(tmp_path):
    """A fresh machine's first `./dev`: each step and what it installs (the dependencies, read from
    pyproject.toml), then how to call .venv's tools. Before it said only "setting up .venv (first run takes about a
    minute)" and went quiet for that minute (checked: this test failed). The venv and pip are stand-ins here
    (a real setup takes a minute and the network or wheel cache): a fake python3 first on PATH makes the venv
    folder with a pip that records its arguments, and hands everything else to the real interpreter."""
    import stat
    import tomllib

    venv, fakebin = tmp_path / "venv", tmp_path / "bin"
    fakebin.mkdir()
    real = sys.executable
    script = os.path.join(os.path.dirname(real), "ragged-optim")
    (fakebin / "python3").write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then\n'
        '  mkdir -p "$3/bin"\n'
        f"""  printf '#!/bin/sh\\necho "$*" >> "%s/pip.log"\\n' "$3" > "$3/bin/pip"\n"""
        f"""  printf '#!/bin/sh\\nexec {real} "$@"\\n' > "$3/bin/python"\n"""
        f'  ln -s {script} "$3/bin/ragged-optim"\n'
        '  chmod +x "$3/bin/pip" "$3/bin/python"\n'
        "  exit 0\n"
        "fi\n"
        f'exec {real} "$@"\n'
    )
    (fakebin / "python3").chmod(stat.S_IRWXU)
    env = {**os.environ, "RO_VENV": str(venv), "PATH": f"{fakebin}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", os.path.join(ROOT, "dev"), "--help"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    project = tomllib.loads(open(os.path.join(ROOT, "pyproject.toml")).read())["project"]
    err = out.stderr
    for step in ("[dev] 1/3 a virtual environment", "[dev] 2/3 torch==2.13.0", "[dev] 3/3 ragged-optim"):
        assert step in err, err
    for dep in project["dependencies"] + project["optional-dependencies"]["dev"]:
        assert dep in err, (dep, err)
    assert "./dev python, ./dev torchrun, ./dev pip" in err
    pip = (venv / "pip.log").read_text().splitlines()
    assert pip[0].startswith("install") and "torch==2.13.0" in pip[0] and "-e .[dev]" in pip[1], pip
    assert (venv / ".ragged-optim-installed").exists() and "usage: ./dev" in out.stdout
