"""What `ragged-optim train` shows while it runs and after (issue 35): progress readable in a log file, with an
ETA; a validation curve of at least 8 points whatever --steps is; the summary's bytes said as what they are, with
the bytes sent and received. Before: a log got every redraw of the bar in one line (``\\r``), no ETA, one
validation point at --steps 50 (--eval-every 50), and "15.12 MiB" per step without saying of what (each checked
to fail)."""

from __future__ import annotations

import io
import json
import os

import pytest

from ragged_optim.cli import main
from ragged_optim.train.config import MIN_EVALS, TrainConfig
from ragged_optim.train.progress import Progress


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_progress_in_a_log_is_plain_lines_with_an_eta():
    stream, clock = io.StringIO(), _Clock()  # a StringIO is no terminal, as a log file is not
    bar = Progress(200, stream=stream, clock=clock)
    for step in range(1, 201):
        clock.t += 0.5  # half a second per step
        bar.update(step, 2.0 + 1 / step, 1234.5)
    bar.close()
    text = stream.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    # the first step, then each tenth of the run: 11 lines for 200 steps, not one per step
    assert [line.split()[1] for line in lines] == ["1/200"] + [f"{20 * k}/200" for k in range(1, 11)]
    assert lines[5] == "step 100/200 (50%)  loss 2.0100  1,234 tok/s  elapsed 0:50  ETA 0:50"
    assert "ETA" not in lines[-1] and "elapsed 1:40" in lines[-1]


def test_progress_in_a_log_also_writes_a_line_per_minute():
    stream, clock = io.StringIO(), _Clock()
    bar = Progress(1000, stream=stream, clock=clock)
    for step in range(1, 31):
        clock.t += 10.0  # a slow run: a tenth of it takes 1000 s
        bar.update(step, 3.0, 10.0)
    assert [line.split()[1] for line in stream.getvalue().splitlines()] == ["1/1000", "7/1000", "13/1000"] + [
        "19/1000",
        "25/1000",
    ]


def test_progress_on_a_terminal_redraws_one_line_with_an_eta():
    stream, clock = io.StringIO(), _Clock()
    bar = Progress(10, stream=stream, min_interval_s=0.0, tty=True, start=4, clock=clock)  # resumed at step 4
    clock.t += 3.0
    bar.update(5, 3.25, 1234.0)  # 3 s for 1 step here: 5 steps left
    text = stream.getvalue()
    assert text.startswith("\rstep  5/10 [") and text.endswith("ETA 0:15")


@pytest.mark.parametrize("steps", [1, 7, 8, 9, 50, 100, 200, 1001])
def test_validation_points_at_least_8_whatever_the_steps(steps):
    cfg = TrainConfig(steps=steps)
    every = cfg.eval_interval()
    points = {s for s in range(1, steps + 1) if s % every == 0} | {steps}
    assert len(points) >= min(MIN_EVALS, steps)
    assert len(points) <= 2 * MIN_EVALS  # not one per step on long runs
    assert TrainConfig(steps=steps, eval_every=0).eval_interval() == 0  # 0: only after the last step, as before


def test_train_log_validation_and_summary_units(tmp_path, capsys):
    """One short run as a user logs it (stderr not a terminal) at --steps 50 on one process: the log's progress
    lines, the validation points the plot draws, the summary's units."""
    out = str(tmp_path / "out")
    argv = ["train", "--optimizer", "adamw", "--preset", "tiny", "--seq-len", "16", "--steps", "50"]
    argv += ["--batch-size", "2", "--world-size", "1", "--fsdp", "none", "--eval-batches", "1", "--out", out]
    assert main(argv) == 0
    captured = capsys.readouterr()
    progress = [line for line in captured.err.splitlines() if line.startswith("step ")]
    assert "\r" not in captured.err and len(progress) == 11 and "ETA" in progress[5], captured.err
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert [s for s, _ in summary["val_losses"]] == [6, 12, 18, 24, 30, 36, 42, 48, 50]
    assert "of buffers (message size" in captured.out and "sent and" in captured.out and "received" in captured.out
    assert summary["comm_sent_bytes_per_step_ring"] == 0.0  # one process: nothing on the wire
