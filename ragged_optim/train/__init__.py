"""`ragged-optim train`, the project's main job: the small GPT on the standard library's own source, sharded with
our FSDP (or torch's), trained with the chosen optimizer. See ``loop`` for how a run is launched."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ragged_optim.cli import module_doc
from ragged_optim.model_presets import PRESETS
from ragged_optim.train.config import FSDP_KINDS, TrainConfig, lr_multiplier
from ragged_optim.train.optimizers import DEFAULT_OPTIMIZER, OPTIMIZERS, make_optimizer

# Imported on first use (PEP 562): the training loop imports torch, and `ragged-optim train --help` needs none.
_LAZY = {name: "ragged_optim.train.loop" for name in ("format_summary", "run", "shard_model", "train_rank")}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'ragged_optim.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "DEFAULT_OPTIMIZER",
    "FSDP_KINDS",
    "OPTIMIZERS",
    "TrainConfig",
    "add_parser",
    "format_summary",
    "lr_multiplier",
    "main",
    "make_optimizer",
    "run",
    "shard_model",
    "train_rank",
]


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default after its help."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    d = TrainConfig()
    lrs = ", ".join(f"{name} {OPTIMIZERS[name].default_lr:g}" for name in sorted(OPTIMIZERS))
    p = subparsers.add_parser(
        "train",
        help="train the small GPT with FSDP and a chosen optimizer",
        description=module_doc("ragged_optim.train.loop"),
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default=d.optimizer,
        help="muon: Muon on hidden matrices, AdamW on the rest; shampoo: blocked Shampoo; soap: SOAP (Adam in "
        "Shampoo's eigenbasis); adamw8bit: 8-bit AdamW; adamw: torch's AdamW",
    )
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps in all (a resumed run stops here too)")
    p.add_argument("--world-size", type=int, default=d.world_size, help="local gloo ranks (ignored under torchrun)")
    p.add_argument("--preset", default=d.preset, help=f"model preset: {', '.join(PRESETS)}")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch size (sequences per step)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (None: the preset's)")
    p.add_argument("--lr", type=float, default=None, help=f"peak learning rate (None: the optimizer's: {lrs})")
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="linear warmup steps, then cosine decay (None: min(20, steps // 10))",
    )
    p.add_argument("--checkpoint-dir", default=None, help="folder for checkpoints (None: no checkpoints)")
    p.add_argument(
        "--checkpoint-every", type=int, default=d.checkpoint_every, help="steps between checkpoints (and the last)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest complete checkpoint (the lr schedule is the one of this run's --steps: "
        "a resume with more steps than the first run continues on a longer schedule)",
    )
    p.add_argument(
        "--out", default=d.out, help="folder for summary.json and loss.png (None: runs/<optimizer>-w<W>-<timestamp>)"
    )
    p.add_argument(
        "--fsdp", choices=FSDP_KINDS, default=d.fsdp, help="ours: RaggedShard; torch: FSDP2; none: one process"
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the model's init and of the batches")
    p.add_argument(
        "--eval-batches", type=int, default=d.eval_batches, help="validation batches per evaluation (0: no validation)"
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=d.eval_every,
        help="steps between validation losses (0: only after the last; None: steps // 8, so that every run "
        "draws at least 8 points of the validation curve)",
    )
    p.add_argument("--log-scale", action="store_true", help="loss.png with a log-scale loss axis")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds before a stuck run is aborted")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress on stderr (when stderr is not a terminal, progress is a plain line every ~10%% of the run, "
        "for logs; this turns that off too)",
    )
    p.set_defaults(func=main_from_args)
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        optimizer=args.optimizer,
        steps=args.steps,
        world_size=args.world_size,
        preset=args.preset,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        out=args.out,
        fsdp=args.fsdp,
        seed=args.seed,
        eval_batches=args.eval_batches,
        eval_every=args.eval_every,
        log_scale=args.log_scale,
        timeout_s=args.timeout,
        progress=not args.no_progress,
    )


def main_from_args(args: argparse.Namespace) -> int:
    from ragged_optim.train.loop import format_summary, run

    summary = run(config_from_args(args))
    if summary is not None:
        print(format_summary(summary))
        out = summary["out"]
        print(f"wrote {os.path.join(out, 'summary.json')} and {os.path.join(out, 'loss.png')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m ragged_optim.train ...``: the `train` subcommand on its own (bad options: an argparse error)."""
    from ragged_optim.cli import main as cli_main

    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])
