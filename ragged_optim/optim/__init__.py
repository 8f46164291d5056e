"""Optimizers: Muon (with AdamW for non-matrix params) and param routing."""

from ragged_optim.optim.muon import BF16_NS_REL_TOL, Muon, MuonItem, adamw_update_, adjust_lr
from ragged_optim.optim.routing import HEAD_NAMES, muon_param_groups

__all__ = ["BF16_NS_REL_TOL", "HEAD_NAMES", "Muon", "MuonItem", "adamw_update_", "adjust_lr", "muon_param_groups"]
