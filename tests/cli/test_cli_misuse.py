"""Bad input to `ragged-optim train` and `ragged-optim plan`: an argparse-style error (usage, `ragged-optim CMD:
error: ...`, exit 2, no traceback) naming the option and the fix, raised before any rank is spawned; and a summary
that never prints a number it does not have."""

from __future__ import annotations

import json
import os

import pytest

from ragged_optim.cli import UsageError, main
from ragged_optim.train import TrainConfig, format_summary, train_rank
from ragged_optim.train.config import ConfigError

# --steps 1 and one process: were a check missing, the run it lets through stays short.
TINY = ["train", "--preset", "tiny", "--steps", "1", "--no-progress"]


@pytest.fixture(autouse=True)
def _no_rank_spawned(monkeypatch):
    """Every bad input here must be refused in the parent: spawning ranks is a failure of the check itself."""
    import ragged_optim.comm.launch as launch

    def refuse(*args, **kwargs):
        raise AssertionError("ranks were spawned for input that should have been refused up front")

    monkeypatch.setattr(launch, "run_on_ranks", refuse)


def _usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith("usage: ragged-optim ")
    return err


def test_config_error_is_a_value_error():
    # API callers who catch ValueError from TrainConfig.validate keep working.
    assert issubclass(ConfigError, UsageError) and issubclass(UsageError, ValueError)
    with pytest.raises(ValueError, match="--batch-size"):
        TrainConfig(batch_size=0).validate(1)


@pytest.mark.parametrize("batch", ["0", "-4"])
def test_batch_size_below_one_is_refused(capsys, batch):
    err = _usage_error(capsys, *TINY, "--batch-size", batch, "--world-size", "1", "--fsdp", "none")
    assert "ragged-optim train: error: --batch-size must be >= 1" in err and f"got {batch}" in err


def test_batch_size_not_divisible_by_world_size_is_refused(capsys):
    err = _usage_error(capsys, *TINY, "--batch-size", "6", "--world-size", "4")
    assert "--batch-size 6 (global) is not divisible by the world size 4; use a multiple of 4" in err


def test_negative_eval_batches_is_refused(capsys):
    err = _usage_error(capsys, *TINY, "--eval-batches", "-1", "--world-size", "1", "--fsdp", "none")
    assert "--eval-batches must be >= 0 (0 skips the validation loss), got -1" in err


def test_world_size_zero_is_refused(capsys):
    err = _usage_error(capsys, *TINY, "--world-size", "0")
    assert "--world-size must be >= 1, got 0" in err
    assert "ZeroDivisionError" not in err


def test_negative_warmup_is_refused(capsys):
    err = _usage_error(capsys, *TINY, "--warmup-steps", "-5", "--world-size", "1", "--fsdp", "none")
    assert "--warmup-steps must be >= 0, got -5" in err


def test_unknown_preset_is_refused_in_the_parent(capsys):
    err = _usage_error(capsys, "train", "--preset", "nosuch", "--steps", "1", "--world-size", "2", "--batch-size", "2")
    assert "unknown --preset 'nosuch'; choose one of: tiny, small, bench20m" in err


@pytest.mark.parametrize("lr", ["-1", "0", "nan", "inf"])
def test_bad_lr_is_refused_in_the_parent(capsys, lr):
    err = _usage_error(capsys, *TINY, "--lr", lr, "--world-size", "2", "--batch-size", "2")
    assert "--lr must be a finite number > 0" in err and "default" in err


@pytest.mark.parametrize(
    "argv, text",
    [
        (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
        (["--timeout", "0"], "--timeout must be a finite number of seconds > 0"),
        (["--seed", "99999999999999999999999"], "--seed must be in [0, 2**63)"),  # (rank 0 died: OverflowError)
        (["--seed", "-1"], "--seed must be in [0, 2**63)"),
    ],
)
def test_other_ranges_are_refused(capsys, argv, text):
    assert text in _usage_error(capsys, *TINY, *argv, "--world-size", "2", "--batch-size", "2")


def _summary(**overrides) -> dict:
    s = {
        "optimizer": "adamw",
        "fsdp": "none",
        "preset": "tiny",
        "n_params": 1234,
        "world_size": 1,
        "steps": 4,
        "start_step": 0,
        "initial_train_loss": 5.5,
        "final_train_loss": 4.0,
        "final_train_loss_avg10": 4.5,
        "val_loss": 4.2,
        "tokens_per_s": 1000.0,
        "train_time_s": 1.0,
        "comm_bytes_per_step": 0.0,
        "collectives_per_step": 0.0,
        "param_bytes_per_rank": [2**20],
        "optimizer_state_bytes_per_rank": [2**21],
    }
    return {**s, **overrides}


def test_format_summary_says_what_is_missing():
    assert "val loss 4.2000" in format_summary(_summary())
    text = format_summary(_summary(val_loss=None))
    assert "val loss skipped (--eval-batches 0)" in text and "0.0000" not in text
    # Resumed at --steps: no step timed, the losses all come from the checkpoint.
    text = format_summary(_summary(start_step=4, tokens_per_s=None, train_time_s=0.0))
    assert "no training steps run (resumed at step 4)" in text and "tokens/s" not in text
    text = format_summary({"preset": "tiny"})  # a partial dict still formats
    assert "n/a" in text


def test_resume_at_or_past_steps(capsys, tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    base = ["train", "--preset", "tiny", "--optimizer", "adamw", "--batch-size", "2", "--world-size", "1"]
    base += ["--fsdp", "none", "--no-progress", "--checkpoint-dir", ckpt, "--out", out]
    # --eval-batches 0 end to end: the summary says the evaluation was skipped.
    assert main([*base, "--steps", "2", "--eval-batches", "0"]) == 0
    printed = capsys.readouterr().out
    assert "val loss skipped (--eval-batches 0)" in printed
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f)["val_loss"] is None

    # Checkpoint past --steps: refused before any rank starts, the way to go on named.
    err = _usage_error(capsys, *base, "--steps", "1", "--resume")
    assert "--steps 1 is below the step of the checkpoint to resume" in err and "step_00000002" in err
    assert "pass --steps greater than 2" in err

    # Checkpoint at --steps: nothing to train, said so, exit 0, no summary rewritten.
    os.remove(os.path.join(out, "summary.json"))
    assert main([*base, "--steps", "2", "--resume"]) == 0
    captured = capsys.readouterr()
    assert "nothing to train" in captured.err and "already at --steps 2" in captured.err
    assert captured.out == "" and not os.path.exists(os.path.join(out, "summary.json"))

    # A checkpoint of another optimizer, model or sharding: refused with the option (was a traceback per rank,
    # after the ranks started; --fsdp torch met torch's "metadata is None").
    for option, value, saved in (("--optimizer", "muon", "adamw"), ("--preset", "small", "tiny")):
        argv = [value if i and base[i - 1] == option else a for i, a in enumerate(base)]
        err = _usage_error(capsys, *argv, "--steps", "3", "--resume")
        assert f"{option} {value} does not match the checkpoint to resume" in err and f"{option} {saved}" in err

    # train_rank (the API, no parent check) refuses too, rather than reporting steps 2..1.
    cfg = TrainConfig(
        optimizer="adamw", preset="tiny", steps=1, world_size=1, batch_size=2, fsdp="none", progress=False
    )
    cfg.checkpoint_dir, cfg.resume, cfg.out = ckpt, True, out
    with pytest.raises(ConfigError, match="below the step of the checkpoint"):
        train_rank(0, 1, cfg)


def test_unusable_out_and_checkpoint_dir_are_refused_before_training(capsys, tmp_path):
    """Before: accepted, then every step trained and the run failed at its first save (a traceback per rank, the
    steps lost) or at writing its summary."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for option in ("--checkpoint-dir", "--out"):
        err = _usage_error(capsys, *TINY, "--world-size", "1", "--fsdp", "none", option, str(a_file))
        assert f"{option} {str(a_file)!r} is a file, not a folder" in err
    err = _usage_error(capsys, *TINY, "--world-size", "1", "--fsdp", "none", "--out", str(a_file / "sub"))
    assert "is not a writable folder" in err


def test_plan_module_must_build_an_nn_module(capsys):
    assert _exit_code(["plan", "--module", "os:getcwd", "--world-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "--module os:getcwd: getcwd() returned a str, not a torch.nn.Module" in err
    assert "named_modules" not in err
    assert _exit_code(["plan", "--module", "os:sep", "--world-size", "4"]) == 2
    assert "sep is a str, not a callable" in capsys.readouterr().err
    assert _exit_code(["plan", "--module", "os:chdir", "--world-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "calling chdir() failed with TypeError" in err and "Traceback" not in err


def test_plan_model_and_module_are_exclusive(capsys):
    err = _usage_error(capsys, "plan", "--module", "torch.nn:Transformer", "--model", "llama3-8b", "--world-size", "4")
    assert "ragged-optim plan: error: argument --model: not allowed with argument --module" in err


@pytest.mark.parametrize(
    "argv, text",
    [
        (["muon", "--world-size", "0"], "--world-size must be >= 1, got 0"),
        (["muon", "--steps", "0"], "--steps must be >= 1, got 0"),
        (["adamw8bit", "--seeds", "0"], "--seeds must be >= 1, got 0"),
        (["peers", "--families", "nosuch"], "--families takes a comma-separated list of ['muon'"),
        (["muon", "--seeds", "2"], "benchmark 'muon' takes no --seeds"),
    ],
)
def test_bench_options_are_refused_as_usage_errors(capsys, argv, text):
    """Before: a ValueError traceback from inside the benchmark, exit 1."""
    assert text in _usage_error(capsys, "bench", *argv)


def test_plan_of_a_model_without_params_is_an_error(capsys):
    """Before: ZeroDivisionError (padding_ratio) with a traceback."""
    assert _exit_code(["plan", "--module", "torch.nn:Identity", "--world-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "has no parameter elements: there is nothing to shard or plan" in err and "Traceback" not in err


def _exit_code(argv) -> int:
    """``main``'s exit status: a usage error exits through argparse (usage line, ``ragged-optim plan: error: ...``)."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_plan_module_of_the_current_folder_imports_as_with_python_m(capsys):
    """The installed ``ragged-optim`` script does not put the current folder on sys.path (``python -m`` does); before,
    ``plan --module examples.torchrun_own_model:TinyLM`` from the repo root failed with a bare ``error: No module
    named 'examples'`` and no usage line. ``-I`` keeps the current folder off sys.path, as the script does."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = "import sys; from ragged_optim.cli import main; sys.exit(main(sys.argv[1:]))"
    run = [sys.executable, "-I", "-c", code, "plan", "--world-size", "2"]
    ok = subprocess.run([*run, "--module", "examples.torchrun_own_model:TinyLM"], cwd=repo, capture_output=True)
    assert ok.returncode == 0, ok.stderr.decode()
    err = _usage_error(capsys, "plan", "--module", "nosuch_pkg_q:X", "--world-size", "2")
    assert "ragged-optim plan: error: --module nosuch_pkg_q:X: cannot import it" in err


def test_a_seq_len_longer_than_the_text_is_a_usage_error(capsys):
    """Before: ``train --preset tiny --seq-len 1000000`` ran for minutes with no output (killed at 300 s)."""
    err = _usage_error(capsys, "train", "--preset", "tiny", "--seq-len", "1000000", "--world-size", "2")
    assert "--seq-len 1000000 is longer than the validation text" in err


@pytest.mark.parametrize(
    "argv, text",
    [
        (["bench", "muon", "--out", "{tmp}"], "is a folder; pass a file for one benchmark's JSON"),
        (["bench", "muon", "--out", "/proc/nope/x.json"], "cannot write in '/proc/nope'"),
        (["bench", "all", "--out", "{tmp}/file"], "bench all writes a folder"),
    ],
)
def test_bench_out_is_checked_before_the_run(capsys, tmp_path, monkeypatch, argv, text):
    """Before: an unusable --out raised a traceback (IsADirectoryError, FileNotFoundError) after the benchmark had
    run, minutes later, and with --json nothing was printed: the results were lost."""
    import ragged_optim.bench.cli as bench_cli

    def refuse(*args, **kwargs):
        raise AssertionError("the benchmark ran before --out was checked")

    monkeypatch.setattr(bench_cli, "run_benchmark", refuse)
    (tmp_path / "file").write_text("")
    assert text in _usage_error(capsys, *[a.format(tmp=tmp_path) for a in argv])
