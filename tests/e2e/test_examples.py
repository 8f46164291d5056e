"""The examples in examples/ run as a user runs them: under torchrun, with 2-3 gloo ranks (one process each).

Each torchrun launch costs ~10-20 s here (process start and imports), so the suite launches each example as few
times as it can: the own-model example with Muon saves on 3 ranks and reloads on 2, with the README's two commands
for it (through ``./dev torchrun``); Shampoo, SOAP and AdamW8bit train and save once each on 2 ranks (their reload at
other world sizes is in test_checkpoint.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import readme_blocks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OWN_MODEL = os.path.join(ROOT, "examples", "torchrun_own_model.py")
HF_LLAMA = os.path.join(ROOT, "examples", "hf_llama.py")


def torchrun(nproc: int, script: str, *args: str, timeout: float = 240) -> str:
    """Run ``torchrun --standalone --nproc-per-node nproc script args``; its output, or a failure that shows it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-6000:]}"
    return out


def _floats(pattern: str, text: str) -> list[float]:
    return [float(m) for m in re.findall(pattern, text)]


def test_own_model_with_muon_saves_on_3_ranks_and_reloads_on_2(tmp_path):
    """The README's two commands for this example, as written but for the checkpoint folder (tmp_path here): Muon
    saves on 3 ranks, and the run resumes on 2."""
    readme = readme_blocks.commands(["./dev", "torchrun"])
    assert [c[c.index("--nproc-per-node") + 1] for c in readme] == ["3", "2"], readme
    ckpt = str(tmp_path / "ckpt")
    runs = []
    for argv in readme:
        argv = [ckpt if i and argv[i - 1] == "--ckpt" else a for i, a in enumerate(argv)]
        proc = subprocess.run(
            [readme_blocks.DEV, *argv[1:]],
            capture_output=True,
            text=True,
            timeout=240,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        runs.append(proc.stdout + proc.stderr)
        assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}:\n{runs[-1][-6000:]}"
    first, second = runs
    evals = _floats(r"eval loss (\d+\.\d+)", first)
    assert len(evals) >= 3 and evals[-1] < evals[0], first  # step 0, 5, ..., 20: it learned
    (saved,) = _floats(r"step 20 on 3 ranks: weights checksum (\S+), saved", first)
    (loaded,) = _floats(r"resumed at step 20 on 2 ranks: weights checksum (\S+)", second)
    assert loaded == saved  # the checkpoint's weights, resharded from 3 ranks to 2, exactly
    assert re.search(r"step 40 on 2 ranks: weights checksum", second), second


@pytest.mark.parametrize("optimizer", ["shampoo", "soap", "adamw8bit"])
def test_own_model_with_each_optimizer(tmp_path, optimizer):
    out = torchrun(2, OWN_MODEL, "--optimizer", optimizer, "--steps", "5", "--ckpt", str(tmp_path / "ckpt"))
    evals = _floats(r"eval loss (\d+\.\d+)", out)
    assert len(evals) == 2 and evals[1] < evals[0], out
    assert os.path.isdir(tmp_path / "ckpt")


def test_hf_llama_with_gradient_checkpointing(tmp_path):
    out_dir = str(tmp_path / "llama")
    out = torchrun(2, HF_LLAMA, "--steps", "3", "--out", out_dir)
    losses = _floats(r"step \d+: loss (\d+\.\d+)", out)
    assert len(losses) == 3 and losses[-1] < losses[0], out
    # save_pretrained wrote the gathered weights: reloaded by transformers, they give the sharded model's eval loss
    (reloaded, sharded) = re.search(r"eval loss (\S+) reloaded, (\S+) sharded", out).groups()
    assert float(reloaded) == float(sharded), out
    assert {"config.json", "model.safetensors"} <= set(os.listdir(out_dir))
