"""Bytes each rank holds: params and optimizer state (local shards, inner tensors of wrapper subclasses)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for ``t``: the local shard of a DTensor, the inner tensors of a wrapper subclass."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if type(t) is not torch.Tensor and not isinstance(t, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def _nested_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return tensor_bytes(obj)
    if isinstance(obj, dict):
        return sum(_nested_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nested_bytes(v) for v in obj)
    return 0


def param_bytes(model: nn.Module) -> int:
    return sum(tensor_bytes(p) for p in model.parameters())


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(_nested_bytes(s) for s in opt.state.values())
