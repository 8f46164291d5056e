"""What one training run is: its configuration and learning-rate schedule."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

from ragged_optim.cli import UsageError
from ragged_optim.model_presets import PRESETS, get_config
from ragged_optim.train.optimizers import DEFAULT_OPTIMIZER, OPTIMIZERS

FSDP_KINDS = ("ours", "torch", "none")
#: validation losses a run computes at least when --eval-every is not given (the last step's included)
MIN_EVALS = 8


class ConfigError(UsageError):
    """A TrainConfig that cannot run; the message names the option and the fix. A ValueError; the CLI prints it
    as an argparse error (exit 2)."""


@dataclass
class TrainConfig:
    optimizer: str = DEFAULT_OPTIMIZER
    steps: int = 200
    world_size: int = 4
    preset: str = "small"
    batch_size: int = 24  # global: every rank gets batch_size // world_size rows
    seq_len: int | None = None  # None: the preset's
    lr: float | None = None  # None: the optimizer's default in OPTIMIZERS
    warmup_steps: int | None = None  # None: min(20, steps // 10)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    resume: bool = False
    out: str | None = None  # None: runs/<optimizer>-w<W>-<timestamp>/ (run_folder)
    fsdp: str = "ours"
    seed: int = 0
    eval_batches: int = 4
    eval_every: int | None = None  # steps between validation losses (0: only after the last step; None: auto)
    log_scale: bool = False  # loss.png's loss axis
    timeout_s: float = 3600.0
    progress: bool = True
    extra: dict = field(default_factory=dict)

    def validate(self, world_size: int) -> None:
        """Check every setting before any rank starts, so bad input fails here, not as a RankFailure later."""
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}; choose one of {sorted(OPTIMIZERS)}")
        if self.fsdp not in FSDP_KINDS:
            raise ConfigError(f"--fsdp must be one of {FSDP_KINDS}, got {self.fsdp!r}")
        if world_size < 1:
            raise ConfigError(f"--world-size must be >= 1, got {world_size}")
        if self.fsdp == "none" and world_size != 1:
            raise ConfigError("--fsdp none trains a single unsharded process; pass --world-size 1")
        if self.preset not in PRESETS:
            raise ConfigError(f"unknown --preset {self.preset!r}; choose one of: {', '.join(PRESETS)}")
        if self.seq_len is not None and self.seq_len < 1:
            raise ConfigError(f"--seq-len must be >= 1, got {self.seq_len} (omit it for the preset's)")
        if self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        if self.batch_size < 1:
            raise ConfigError(
                f"--batch-size must be >= 1 (global sequences per step, a multiple of the world size {world_size}), "
                f"got {self.batch_size}"
            )
        if self.batch_size % world_size:
            raise ConfigError(
                f"--batch-size {self.batch_size} (global) is not divisible by the world size {world_size}; "
                f"use a multiple of {world_size}"
            )
        # `not lr > 0` also catches NaN; an infinite lr would train to NaN.
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            default = OPTIMIZERS[self.optimizer].default_lr
            raise ConfigError(
                f"--lr must be a finite number > 0, got {self.lr} (omit it for {self.optimizer}'s default {default})"
            )
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ConfigError(
                f"--warmup-steps must be >= 0, got {self.warmup_steps} (omit it for min(20, steps // 10))"
            )
        if self.eval_batches < 0:
            raise ConfigError(f"--eval-batches must be >= 0 (0 skips the validation loss), got {self.eval_batches}")
        if self.eval_every is not None and self.eval_every < 0:
            raise ConfigError(f"--eval-every must be >= 0 (0: only after the last step), got {self.eval_every}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"--timeout must be a finite number of seconds > 0, got {self.timeout_s}")
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("--resume needs --checkpoint-dir")
        if self.checkpoint_every < 1:
            raise ConfigError(f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")
        if not 0 <= self.seed < 2**63:  # (torch.manual_seed's range: beyond it rank 0 died with an OverflowError)
            raise ConfigError(f"--seed must be in [0, 2**63), got {self.seed}")
        if self.keep_checkpoints < 1:  # 0 would delete each checkpoint right after writing it
            raise ConfigError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        for option, folder in (("--checkpoint-dir", self.checkpoint_dir), ("--out", self.out)):
            if folder is not None:
                _check_folder(option, folder)

    def eval_interval(self) -> int:
        """Steps between validation losses: ``eval_every``, or when None ``steps // 8`` (at least 1), so that a run
        of any length draws at least 8 points of its validation curve (a fixed 50 would draw one at --steps 50).
        0: only after the last step."""
        if self.eval_every is not None:
            return self.eval_every
        return max(1, self.steps // MIN_EVALS)

    def model_config(self):
        overrides = {} if self.seq_len is None else {"seq_len": self.seq_len}
        return get_config(self.preset, **overrides)


def _check_folder(option: str, folder: str) -> None:
    """A folder the run will create or write into: refused now when it cannot be, rather than after training."""
    if not folder:
        raise ConfigError(f"{option} is empty; pass a folder")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ConfigError(f"{option} {folder!r} is a file, not a folder; pass a folder (it is created if missing)")
    parent = os.path.abspath(folder)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {folder!r}: {parent!r} is not a writable folder, so the run could not write there")


def run_folder(cfg: TrainConfig, world_size: int, root: str = "runs") -> str:
    """Where a run writes summary.json and loss.png: ``--out`` if given, else a folder of its own,
    ``runs/<optimizer>-w<W>-<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``, ... if a run of the same second has it)."""
    if cfg.out:
        return cfg.out
    base = os.path.join(root, f"{cfg.optimizer}-w{world_size}-{time.strftime('%Y%m%d-%H%M%S')}")
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def lr_multiplier(step: int, steps: int, warmup: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to 10% at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))
