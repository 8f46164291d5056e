"""Optimizers: Muon (with AdamW for non-matrix params), Shampoo, SOAP, AdamW8bit, and param routing."""

from ragged_optim.optim.adamw import adamw_update_
from ragged_optim.optim.adamw8bit import AdamW8bit
from ragged_optim.optim.muon import BF16_NS_REL_TOL, Muon, MuonItem, adjust_lr
from ragged_optim.optim.routing import HEAD_NAMES, muon_param_groups
from ragged_optim.optim.shampoo import GRAFTING_METHODS, Shampoo
from ragged_optim.optim.soap import SOAP

__all__ = [
    "BF16_NS_REL_TOL",
    "GRAFTING_METHODS",
    "HEAD_NAMES",
    "AdamW8bit",
    "Muon",
    "MuonItem",
    "SOAP",
    "Shampoo",
    "adamw_update_",
    "adjust_lr",
    "muon_param_groups",
]
