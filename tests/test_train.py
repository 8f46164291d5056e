"""The `train` job: summary and plot, sharded == unsharded losses, checkpoint + resume, the pieces it uses.

One 2-rank run of the tiny preset (checkpointing every 3 of 6 steps) is shared by several checks, once with torch's
FSDP2 (``--fsdp torch``) and once with the ragged runtime (``--fsdp ours``): both must give the losses of the
one-process run.
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

from ragged_optim.comm.counter import count_collectives
from ragged_optim.train import DEFAULT_OPTIMIZER, OPTIMIZERS, add_parser, lr_multiplier, main, make_optimizer
from ragged_optim.train.accounting import optimizer_state_bytes, param_bytes
from ragged_optim.train.checkpointing import latest_checkpoint
from ragged_optim.train.loss_plot import _write_png, write_loss_png
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
    "losses",
}


def _summary(out) -> dict:
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module", params=["torch", "ours"])
def sharded_run(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(f"train_{kind}")
    out, ckpt = str(root / "out"), str(root / "ckpt")
    args = [*COMMON, "--world-size", "2", "--fsdp", kind, "--out", out, "--checkpoint-dir", ckpt]
    assert main([*args, "--checkpoint-every", "3"]) == 0
    return kind, root, args, _summary(out)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("single"))
    assert main([*COMMON, "--world-size", "1", "--fsdp", "none", "--out", out]) == 0
    return _summary(out)


def _check_png(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks.setdefault(kind, b"")
        chunks[kind] += body
        pos += 12 + length
    assert set(chunks) >= {b"IHDR", b"IDAT", b"IEND"}
    w, h = struct.unpack(">II", chunks[b"IHDR"][:8])
    assert w > 0 and h > 0
    if chunks[b"IHDR"][8:10] == b"\x08\x02":  # our own writer: 8-bit RGB, filter byte per row
        assert len(zlib.decompress(chunks[b"IDAT"])) == h * (1 + 3 * w)
    return w, h


def test_sharded_run_writes_summary_and_plot(sharded_run):
    kind, root, _, s = sharded_run
    assert SUMMARY_KEYS <= set(s)
    assert s["fsdp"] == kind and s["world_size"] == 2 and len(s["losses"]) == STEPS
    assert s["losses"][-1] < s["losses"][0]
    assert s["collectives_per_step"] > 0 and s["comm_bytes_per_step"] > 0
    assert {"all_gather", "reduce_scatter"} <= s["comm_by_collective"].keys()
    # each rank holds about half of the fp32 params and two AdamW moments of that half
    full = s["n_params"] * 4
    for pb, ob in zip(s["param_bytes_per_rank"], s["optimizer_state_bytes_per_rank"]):
        assert full / 2 <= pb < full * 0.6
        assert 2 * pb <= ob < 2 * pb + 1024
    _check_png(os.path.join(root, "out", "loss.png"))


def test_one_process_matches_two_rank_fsdp(sharded_run, single_run):
    kind, _, _, s = sharded_run
    single = single_run
    assert single["world_size"] == 1 and single["collectives_per_step"] == 0
    assert single["param_bytes_per_rank"][0] == single["n_params"] * 4
    # same init and global batches: only fp32 summation order differs (~5e-7 seen for both kinds). AdamW is nearly
    # scale-invariant, so a grad off by a constant factor stays under 1e-5; test_fsdp_runtime checks grads directly
    for step, (a, b) in enumerate(zip(single["losses"], s["losses"], strict=True)):
        assert abs(a - b) < 1e-5, f"step {step}: one process {a} vs 2-rank FSDP {kind} {b}"
    assert abs(single["val_loss"] - s["val_loss"]) < 1e-5


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
    assert r["losses"][:3] == s["losses"][:3]
    for a, b in zip(r["losses"][3:], s["losses"][3:]):
        assert abs(a - b) < 1e-6
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
    assert set(OPTIMIZERS) == {"adamw", "muon", "shampoo", "adamw8bit"}
    model = torch.nn.Linear(4, 3)
    opt = make_optimizer("adamw", model)
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["lr"] == OPTIMIZERS["adamw"].default_lr
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert param_bytes(model) == 15 * 4
    assert optimizer_state_bytes(opt) >= 2 * 15 * 4
    with pytest.raises(ValueError, match="unknown optimizer"):
        make_optimizer("sgd", model)


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
    bar = Progress(10, stream=stream, min_interval_s=0.0)
    bar.update(5, 3.25, 1234.0)
    bar.update(10, 2.5, 2000.0)
    bar.close()
    text = stream.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and "loss 2.5000" in text and "2,000 tok/s" in text
    path = str(tmp_path / "curve.png")
    write_loss_png(path, [5.5, 4.0, float("nan"), 3.0, 2.9], val_loss=3.1)
    _check_png(path)
    own = str(tmp_path / "own.png")
    _write_png(own, [bytearray(b"\x00\x80\xff" * 4) for _ in range(3)])
    assert _check_png(own) == (4, 3)
