"""What one training run is: its configuration and learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ragged_optim.models import get_config
from ragged_optim.train.optimizers import DEFAULT_OPTIMIZER, OPTIMIZERS

FSDP_KINDS = ("ours", "torch", "none")


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
    out: str = "runs/train"
    fsdp: str = "ours"
    seed: int = 0
    eval_batches: int = 4
    timeout_s: float = 3600.0
    progress: bool = True
    extra: dict = field(default_factory=dict)

    def validate(self, world_size: int) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose one of {sorted(OPTIMIZERS)}")
        if self.fsdp not in FSDP_KINDS:
            raise ValueError(f"--fsdp must be one of {FSDP_KINDS}, got {self.fsdp!r}")
        if self.fsdp == "none" and world_size != 1:
            raise ValueError("--fsdp none trains a single unsharded process; pass --world-size 1")
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.batch_size % world_size:
            raise ValueError(
                f"--batch-size {self.batch_size} (global) is not divisible by the world size {world_size}; "
                f"use a multiple of {world_size}"
            )
        if self.resume and not self.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir")
        if self.checkpoint_every < 1:
            raise ValueError(f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")

    def model_config(self):
        overrides = {} if self.seq_len is None else {"seq_len": self.seq_len}
        return get_config(self.preset, **overrides)


def lr_multiplier(step: int, steps: int, warmup: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to 10% at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))
