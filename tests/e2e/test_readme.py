"""Every command and script in README.md runs as written, in a fresh shell after the two setup commands (issue 35).

Before: `torchrun ...` was `command not found` (nothing said to use .venv's), the main snippet raised `NameError:
name 'TinyLM' is not defined` (and used `F`, `batch`, `steps`, `vx`, `vy` without defining them), the hypothesis
snippet needed `make_model` and `MyOptimizer` without saying so, and `BandSign` needed `import torch, ragged_optim
as ro` and lacked torch's `step(closure=None)`, so torch's `get_state_dict` failed on it (each checked: these
tests failed on the README before).

Python blocks: each is a script whose first line names its file and the command that runs it; it is saved under
that name in an empty folder and run with that command (``./dev`` by its path). A ``./dev python NAME.py`` script
runs in this process instead (``runpy``, a fresh namespace: a missing import still fails; it saves an interpreter
start and torch's import). An excerpt would instead be labelled ``Excerpt of [`PATH`](PATH)`` and each of its
lines checked to be in that file; the README has none now.

Bash blocks, command by command (a command this file does not know fails the test, so a new one gets checked):
- run as written: ``./dev --help`` (through ./dev), ``./dev plan ...`` (what ./dev runs, ``ragged-optim plan
  ...``, in this process: a second each);
- parsed only (each runs minutes): ``./dev train ...`` and ``./dev bench ...`` by the command line's own parser
  and ``TrainConfig.validate``; ``./dev test FILE ...``: FILE exists (``./dev test FILE -q`` itself is run by
  tests/e2e/test_dev_script.py);
- ``./dev test`` alone is the suite this file is part of (CI runs it, ``.ci/run``);
- ``./dev torchrun ... examples/torchrun_own_model.py ...``: run by tests/e2e/test_examples.py, which takes its
  commands from the README (one launch per command, shared with that test); parsed here by the example's parser.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import runpy
import subprocess

import pytest
from readme_blocks import DEV, ROOT, blocks, commands

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# what a script block must also survive after it ran as written (appended to it)
AFTERWARDS = {
    # torch's DCP helpers call optim.step(closure=None) on an optimizer without state or grads
    "band_sign.py": "from torch.distributed.checkpoint.state_dict import get_state_dict\n\n"
    "opt.zero_grad()\nget_state_dict(model, opt)\n",
}


def _python_blocks():
    return [b for b in blocks() if b.lang == "python"]


def _run(argv: list[str], cwd: str, timeout: float = 180) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=ENV)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(argv)} (in {cwd}) exited {proc.returncode}:\n{out[-4000:]}"
    return out


def _dev(argv: list[str]) -> list[str]:
    assert argv[0] == "./dev", f"{argv}: README commands run through ./dev (or .venv/bin/...), from the repo root"
    return [DEV, *argv[1:]]


def test_every_python_block_is_a_script_or_a_labelled_excerpt():
    found = _python_blocks()
    assert len(found) >= 3
    for b in found:
        if b.excerpt_of():
            path = os.path.join(ROOT, b.excerpt_of())
            assert os.path.isfile(path), f"{b.where}: the excerpt links to {b.excerpt_of()}, which is not there"
            source = {line.strip() for line in open(path, encoding="utf-8")}
            for line in b.code.splitlines():
                if line.strip() and not line.strip().startswith("#"):
                    assert line.strip() in source, f"{b.where}: {line.strip()!r} is not in {b.excerpt_of()}"
        else:
            assert b.script(), f"{b.where}: start it with '# NAME.py: run with  COMMAND', or label it an excerpt"


@pytest.mark.parametrize("block", [b for b in _python_blocks() if b.script()], ids=lambda b: b.script()[0])
def test_python_block_runs_as_written(block, tmp_path, monkeypatch):
    name, command = block.script()
    (tmp_path / name).write_text(block.code + AFTERWARDS.get(name, ""))
    if command.split() == ["./dev", "python", name]:
        monkeypatch.chdir(tmp_path)
        runpy.run_path(name, run_name="__main__")
        return
    out = _run(_dev(command.split()), cwd=str(tmp_path))
    if name == "my_train.py":  # it trained (the loss fell) and saved its checkpoint where it says
        losses = [float(v) for v in re.findall(r"val loss (\d+\.\d+)", out)]
        assert len(losses) == 4 and losses[-1] < losses[0], out
        assert (tmp_path / "runs" / "my_ckpt").is_dir()


def _example_parser():
    spec = importlib.util.spec_from_file_location("own_model", os.path.join(ROOT, "examples", "torchrun_own_model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse_args


def _parse(argv: list[str]) -> None:
    """``./dev train|bench ...`` parsed by the command line itself, and a train config validated."""
    from ragged_optim.cli import build_parser
    from ragged_optim.train import config_from_args

    try:
        args = build_parser().parse_args(argv[1:])
    except SystemExit as e:
        raise AssertionError(f"{' '.join(argv)}: refused by its parser (exit {e.code})") from e
    if argv[1] == "train":
        config_from_args(args).validate(args.world_size)


def test_every_bash_command_runs_or_parses():
    run, parsed, collected, examples = [], [], [], []
    for b in blocks():
        if b.lang != "bash":
            continue
        for argv in b.commands():
            _dev(argv)
            sub = argv[1] if len(argv) > 1 else None
            if sub in (None, "--help") or sub == "plan":
                run.append(argv)
            elif sub in ("train", "bench"):
                parsed.append(argv)
            elif sub == "test":
                if len(argv) > 2:
                    collected.append(argv)
            elif sub == "torchrun" and "examples/torchrun_own_model.py" in argv:
                examples.append(argv)
            else:
                raise AssertionError(f"{b.where}: {' '.join(argv)}: this test does not know how to check it")
    assert run and parsed and collected and len(examples) == 2
    for argv in parsed:
        _parse(argv)
    parse_example = _example_parser()
    for argv in examples:
        parse_example(argv[argv.index("examples/torchrun_own_model.py") + 1 :])
    assert examples == commands(["./dev", "torchrun"])  # what test_examples.py runs
    from ragged_optim.cli import main

    for argv in run:
        if argv[1:2] == ["plan"]:
            with contextlib.redirect_stdout(io.StringIO()) as out:
                assert main(argv[1:]) == 0, argv
            assert out.getvalue().startswith("model ") or out.getvalue().startswith("{"), out.getvalue()[:200]
        else:
            _run(_dev(argv), cwd=ROOT, timeout=120)
    for argv in collected:
        files = [a for a in argv[2:] if not a.startswith("-")]
        assert files and all(os.path.isfile(os.path.join(ROOT, f)) for f in files), argv
