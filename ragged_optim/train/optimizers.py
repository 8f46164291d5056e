"""The one place that maps an optimizer name to a constructor for the training job."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and the optimizers are imported when one is built: `ragged-optim train --help` needs none
    import torch
    import torch.nn as nn

# The optimizer `ragged-optim train` uses when --optimizer is not given.
DEFAULT_OPTIMIZER = "muon"
# Muon's AdamW side (embeddings, head, 1-D params): fixed, so that --optimizer adamw's default lr can follow its own
# sweep without moving Muon's (Muon's sweep ran with this).
MUON_ADAMW_LR = 4e-3


def _adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    import torch

    # foreach=False: the same per-param arithmetic on DTensor shards and on plain tensors.
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)


def _muon(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    # Hidden matrices get Muon at ``lr``; embeddings, head and 1-D params get AdamW at MUON_ADAMW_LR.
    # Newton-Schulz in bf16 on GPUs (torch.optim.Muon's choice); in fp32 on CPUs: without a bf16 GEMM, bf16 NS
    # runs as fp32 matmuls anyway (ns_matmul="auto"), so fp32 costs about the same and rounds less.
    import torch

    from ragged_optim.optim import Muon, muon_param_groups

    groups = muon_param_groups(model)
    ns_dtype = torch.bfloat16 if next(model.parameters()).is_cuda else torch.float32
    return Muon(groups, lr=lr, ns_dtype=ns_dtype, adamw_lr=MUON_ADAMW_LR, adamw_betas=(0.9, 0.95))


def _shampoo(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    from ragged_optim.optim import Shampoo

    return Shampoo(model.parameters(), lr=lr)


def _soap(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    # The reference implementation's defaults (betas (0.95, 0.95), weight decay 0.01, a basis refresh every 10
    # steps); every matrix of the presets has fewer rows than max_preconditioner_dim, so each is one band.
    from ragged_optim.optim import SOAP

    return SOAP(model.parameters(), lr=lr)


def _adamw8bit(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    from ragged_optim.optim import AdamW8bit

    return AdamW8bit(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


@dataclass(frozen=True)
class OptimizerEntry:
    build: Callable[[nn.Module, float], torch.optim.Optimizer]
    default_lr: float


# Default lrs: the best mean validation loss of the lr sweep of this job at its defaults (benchmarks/lr_sweep.py,
# benchmarks/results/lr_sweep_200steps.json; tests/train/test_lr_defaults.py keeps the two equal).
OPTIMIZERS: dict[str, OptimizerEntry] = {
    "adamw": OptimizerEntry(_adamw, 1e-3),
    "muon": OptimizerEntry(_muon, 5e-2),
    "shampoo": OptimizerEntry(_shampoo, 1e-2),
    "adamw8bit": OptimizerEntry(_adamw8bit, 1e-3),
    "soap": OptimizerEntry(_soap, 1e-2),
}


def make_optimizer(name: str, model: nn.Module, lr: float | None = None) -> torch.optim.Optimizer:
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {sorted(OPTIMIZERS)}")
    entry = OPTIMIZERS[name]
    return entry.build(model, entry.default_lr if lr is None else lr)
