"""The `train` job: summary and plot, sharded == unsharded losses, checkpoint + resume, the pieces it uses.

One 2-rank run of the tiny preset (checkpointing and evaluating every 3 of 6 steps) is shared by several checks,
once with torch's FSDP2 (``--fsdp torch``) and once with the ragged runtime (``--fsdp ours``): both must give the
losses of the one-process run, ours within the distance FSDP2 has in the same run.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import struct
import zlib

import pytest
import torch
from noise_bounds import assert_within_reference

from ragged_optim.comm.counter import count_collectives
from ragged_optim.train import (
    DEFAULT_OPTIMIZER,
    OPTIMIZERS,
    add_parser,
    format_summary,
    lr_multiplier,
    main,
    make_optimizer,
)
from ragged_optim.train.accounting import optimizer_state_bytes, param_bytes
from ragged_optim.train.checkpointing import latest_checkpoint
from ragged_optim.train.loss_plot import write_loss_png
from ragged_optim.train.progress import Progress

STEPS = 6
COMMON = [
    "--optimizer",
    "adamw",
    "--preset",
    "tiny",
    "--steps",
    str(STEPS),
    "--batch-size",
    "8",
    "--seed",
    "7",
    "--eval-every",
    "3",
    "--no-progress",
]
SUMMARY_KEYS = {
    "final_train_loss",
    "val_loss",
    "tokens_per_s",
    "comm_bytes_per_step",
    "collectives_per_step",
    "param_bytes_per_rank",
    "optimizer_state_bytes_per_rank",
    "optimizer_state_max_over_mean",
    "losses",
}


def _summary(out) -> dict:
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


_RUNS: dict[str, tuple] = {}  # kind -> (root, args, summary): each 2-rank run once per session


def _sharded(kind: str, tmp_path_factory) -> tuple:
    if kind not in _RUNS:
        root = tmp_path_factory.mktemp(f"train_{kind}")
        out, ckpt = str(root / "out"), str(root / "ckpt")
        args = [*COMMON, "--world-size", "2", "--fsdp", kind, "--out", out, "--checkpoint-dir", ckpt]
        assert main([*args, "--checkpoint-every", "3"]) == 0
        _RUNS[kind] = (root, args, _summary(out))
    return _RUNS[kind]


@pytest.fixture(scope="module", params=["torch", "ours"])
def sharded_run(request, tmp_path_factory):
    return (request.param, *_sharded(request.param, tmp_path_factory))


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("single"))
    assert main([*COMMON, "--world-size", "1", "--fsdp", "none", "--out", out]) == 0
    return _summary(out)


def _png_chunks(path: str) -> dict[bytes, list[bytes]]:
    """The chunks of a PNG file by type, each CRC checked."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks.setdefault(kind, []).append(body)
        pos += 12 + length
    return chunks


def _check_png(path: str) -> tuple[int, int]:
    """A PNG drawn by matplotlib (its ``Software`` text chunk says so; the hand-written rasteriser this replaced
    wrote none), 640 x 360 pixels; returns (width, height)."""
    chunks = _png_chunks(path)
    assert {b"IHDR", b"IDAT", b"IEND"} <= set(chunks)
    text = dict(body.split(b"\0", 1) for body in chunks.get(b"tEXt", []))
    assert text.get(b"Software", b"").startswith(b"Matplotlib"), text
    w, h = struct.unpack(">II", chunks[b"IHDR"][0][:8])
    assert (w, h) == (640, 360)
    return w, h


def test_sharded_run_writes_summary_and_plot(sharded_run):
    kind, root, _, s = sharded_run
    assert SUMMARY_KEYS <= set(s)
    assert s["fsdp"] == kind and s["world_size"] == 2 and len(s["losses"]) == STEPS
    assert s["out"] == str(root / "out")
    # validation at each evaluation (--eval-every 3) and after the last step, for the plot's validation curve
    assert [step for step, _ in s["val_losses"]] == [3, STEPS] and s["val_losses"][-1][1] == s["val_loss"]
    assert s["losses"][-1] < s["losses"][0]
    assert s["collectives_per_step"] > 0 and s["comm_bytes_per_step"] > 0
    assert {"all_gather", "reduce_scatter"} <= s["comm_by_collective"].keys()
    # each rank holds about half of the fp32 params and two AdamW moments of that half
    full = s["n_params"] * 4
    for pb, ob in zip(s["param_bytes_per_rank"], s["optimizer_state_bytes_per_rank"]):
        assert full / 2 <= pb < full * 0.6
        assert 2 * pb <= ob < 2 * pb + 1024
    _check_png(os.path.join(root, "out", "loss.png"))


def test_one_process_matches_two_rank_fsdp(tmp_path_factory, single_run):
    single = single_run
    assert single["world_size"] == 1 and single["collectives_per_step"] == 0
    assert single["param_bytes_per_rank"][0] == single["n_params"] * 4
    ours, torch_fsdp = _sharded("ours", tmp_path_factory)[2], _sharded("torch", tmp_path_factory)[2]

    def gap(s: dict) -> float:
        pairs = zip([*single["losses"], single["val_loss"]], [*s["losses"], s["val_loss"]], strict=True)
        return max(abs(a - b) for a, b in pairs)

    # Same init and global batches: only the fp32 summation order differs (2 ranks' partial sums, gloo's
    # reduce-scatter), for torch's FSDP2 as for ours. FSDP2 is the control: its gap, measured here, bounds ours.
    losses = single["losses"]
    mean_step_change = sum(abs(a - b) for a, b in zip(losses, losses[1:])) / (len(losses) - 1)
    assert gap(torch_fsdp) < 1e-3 * mean_step_change, "the control itself drifted from the one-process run"
    assert_within_reference(gap(ours), gap(torch_fsdp), max(losses), "2-rank ours vs one process (losses)")


def test_resume_continues_the_same_run(sharded_run):
    _, root, args, s = sharded_run
    ckpt = str(root / "ckpt")
    assert latest_checkpoint(ckpt).endswith(f"step_{STEPS:08d}")
    shutil.rmtree(os.path.join(ckpt, f"step_{STEPS:08d}"))  # as if the run had died after step 3
    assert latest_checkpoint(ckpt).endswith("step_00000003")
    os.makedirs(os.path.join(ckpt, "step_00000005"))  # an incomplete folder (no meta.json) is skipped
    assert latest_checkpoint(ckpt).endswith("step_00000003")
    shutil.rmtree(os.path.join(ckpt, "step_00000005"))
    out = str(root / "resumed")
    args = [a if a != str(root / "out") else out for a in args]
    assert main([*args, "--checkpoint-every", "100", "--resume"]) == 0
    r = _summary(out)
    assert r["start_step"] == 3 and len(r["losses"]) == STEPS
    # the same ranks, ops and restored state and RNG as the uninterrupted run: the same losses, bit for bit
    assert r["losses"] == s["losses"]
    assert r["val_losses"] == s["val_losses"]  # step 3's evaluation from the checkpoint's history, step 6's rerun
    # the summary starts where this run started (the loss at step 3), not at step 1 of the first run
    assert r["resumed"] and r["initial_train_loss_step"] == 3 and r["initial_train_loss"] == s["losses"][2]
    text = format_summary(r)
    assert f"train loss {s['losses'][2]:.4f} at step 3 (resumed there)" in text and "steps 4..6" in text, text
    assert not any(d.startswith(".tmp") for d in os.listdir(ckpt))


def test_cli_wiring_and_argument_errors(capsys):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train"])
    assert args.func.__name__ == "main_from_args"
    assert args.optimizer == DEFAULT_OPTIMIZER and args.world_size == 4 and args.preset == "small"
    assert args.steps == 200 and args.fsdp == "ours"
    # python -m ragged_optim.train: bad options are argparse errors (exit 2, the message on stderr)
    for argv, message in [
        (["--preset", "tiny", "--world-size", "3", "--batch-size", "8", "--fsdp", "torch"], "divisible"),
        (["--world-size", "2", "--fsdp", "none"], "--world-size 1"),
        (["--resume", "--world-size", "1", "--fsdp", "none"], "--checkpoint-dir"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_optimizer_registry():
    assert set(OPTIMIZERS) == {"adamw", "muon", "shampoo", "adamw8bit", "soap"}
    model = torch.nn.Linear(4, 3)
    opt = make_optimizer("adamw", model)
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["lr"] == OPTIMIZERS["adamw"].default_lr
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert param_bytes(model) == 15 * 4
    assert optimizer_state_bytes(opt) >= 2 * 15 * 4
    with pytest.raises(ValueError, match="unknown optimizer"):
        make_optimizer("sgd", model)


@pytest.mark.parametrize("fsdp", ["ours", "torch"])
def test_train_with_soap(tmp_path, fsdp):
    """`train --optimizer soap` on 2 ranks, ragged-sharded and torch FSDP2: the loss goes down (the first step only
    accumulates SOAP's statistics), and the run writes its summary."""
    argv = [*COMMON, "--steps", "5", "--world-size", "2", "--fsdp", fsdp, "--out", str(tmp_path)]
    argv[argv.index("adamw")] = "soap"
    assert main(argv) == 0
    s = _summary(str(tmp_path))
    assert s["optimizer"] == "soap" and len(s["losses"]) == 5 and s["losses"][-1] < s["losses"][0]


def test_lr_schedule():
    assert lr_multiplier(0, 100, 10) == pytest.approx(0.1)
    assert lr_multiplier(9, 100, 10) == pytest.approx(1.0)
    assert lr_multiplier(10, 100, 10) == pytest.approx(1.0)
    assert lr_multiplier(99, 100, 10) == pytest.approx(0.1)
    assert lr_multiplier(0, 1, 0) == pytest.approx(1.0)


def test_comm_counter_patches_and_restores():
    import torch.distributed as dist

    orig = dist.all_reduce
    with count_collectives() as counter:
        assert dist.all_reduce is not orig and dist.all_reduce.__wrapped__ is orig
    assert dist.all_reduce is orig and counter.total_calls == 0


def test_progress_line_and_png_writer(tmp_path):
    stream = io.StringIO()
    bar = Progress(10, stream=stream, min_interval_s=0.0, tty=True)  # a terminal: one line, redrawn
    bar.update(5, 3.25, 1234.0)
    bar.update(10, 2.5, 2000.0)
    bar.close()
    text = stream.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and "loss 2.5000" in text and "2,000 tok/s" in text
    path = str(tmp_path / "curve.png")
    write_loss_png(path, [5.5, 4.0, float("nan"), 3.0, 2.9], [(2, 4.2), (5, 3.1)], "title", log_scale=True)
    _check_png(path)


def test_each_run_gets_its_own_folder(tmp_path, monkeypatch, capsys):
    """Before: every run wrote runs/train/, so a second run overwrote the first (checked: this test failed)."""
    monkeypatch.chdir(tmp_path)
    argv = ["--optimizer", "adamw", "--preset", "tiny", "--steps", "2", "--batch-size", "2", "--world-size", "1"]
    argv += ["--fsdp", "none", "--no-progress", "--eval-batches", "1"]
    folders = []
    for _ in range(2):
        assert main(argv) == 0
        captured = capsys.readouterr()
        folder = captured.err.split("run folder: ", 1)[1].split("\n", 1)[0]
        assert folder.startswith(os.path.join("runs", "adamw-w1-")), captured.err
        assert f"wrote {os.path.join(folder, 'summary.json')} and {os.path.join(folder, 'loss.png')}" in captured.out
        assert _summary(folder)["out"] == folder
        _check_png(os.path.join(folder, "loss.png"))
        folders.append(folder)
    assert folders[0] != folders[1]


def test_every_train_option_has_help_and_its_default():
    """Before: --optimizer, --steps, --warmup-steps, ... had no help and no option showed its default (checked)."""
    parser = argparse.ArgumentParser()
    train = add_parser(parser.add_subparsers(dest="command"))
    text = train.format_help()
    for action in train._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} has no help"
    assert "(default: 200)" in text and "(default: muon)" in text and "(default: None)" in text


def test_one_process_reference_is_bitwise_one_rank_sharded(tmp_path):
    """``--fsdp none`` is the reference sharded runs must match: it now runs on one thread, as each forked rank does.
    Before, it used torch's default thread count, and Shampoo's inverse roots turned the different summation
    order into 5.6e-2 of final loss (bitwise equal with OMP_NUM_THREADS=1)."""
    losses = {}
    for fsdp in ("none", "ours"):
        out = str(tmp_path / fsdp)
        argv = [*COMMON, "--steps", "4", "--world-size", "1", "--fsdp", fsdp, "--out", out]
        argv[argv.index("adamw")] = "shampoo"
        assert main(argv) == 0
        losses[fsdp] = _summary(out)["losses"]
    assert losses["none"] == losses["ours"]


def test_default_run_folder_is_checked_before_any_rank_starts(monkeypatch, capsys, tmp_path):
    """Without --out the run folder is chosen in the parent; it is now validated there too. Before, an unwritable
    default folder was found by every rank: a RankFailure traceback naming an --out never passed."""
    from ragged_optim.train import loop

    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a folder under a file cannot be made, by root either
    monkeypatch.setattr(loop, "run_folder", lambda cfg, world_size: str(blocker / "run"))
    monkeypatch.setattr(loop, "run_on_ranks", None, raising=False)  # (reaching the ranks would fail loudly)
    with pytest.raises(SystemExit) as e:
        main([*COMMON, "--world-size", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "is not a writable folder" in err and "Traceback" not in err


def test_two_runs_sharing_a_checkpoint_dir_keep_their_own_writes(tmp_path, monkeypatch):
    """Two jobs given one --checkpoint-dir: each save now writes into a folder of its own before the rename. Before,
    both used ``.tmp-step_N`` and each rank 0 deleted the other's: the second job died at its first checkpoint
    (``Parent directory .../.tmp-step_00000001/state.tmp-... does not exist``). Here job B's whole save runs in
    the middle of job A's (after A's model state, before its RNG state)."""
    from ragged_optim.train import checkpointing
    from ragged_optim.train.checkpointing import Checkpointer, latest_checkpoint

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a, b = (Checkpointer(str(tmp_path), "torch", 0, 1) for _ in range(2))
    real_save, nested = torch.save, []

    def save_with_b_inside(*args, **kwargs):
        if not nested:
            nested.append("b started")
            nested.append(b.save(1, model, opt, {"job": "b"}))
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpointing.torch, "save", save_with_b_inside)
    a.save(1, model, opt, {"job": "a"})
    assert nested and latest_checkpoint(str(tmp_path)).endswith("step_00000001")
