"""Bytes each rank holds (params and optimizer state: local shards, inner tensors of wrapper subclasses), and the
bytes its collectives put on the wire."""

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


#: the share of a collective's buffer (message size) that one rank sends, and as much it receives, under ring
#: algorithms, by kind; times (W - 1) / W
_RING_FACTOR = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0, "broadcast": 1.0, "all_reduce": 2.0}


def ring_wire_bytes(bytes_by_kind: dict[str, float], world_size: int) -> float:
    """Bytes one rank sends (and as many it receives) for collectives of these buffer sizes (``CommStats.bytes``:
    the message size of each kind) over ``world_size`` ranks, under ring algorithms: (W-1)/W of each all-gather
    output, reduce-scatter or all-to-all input (an even split) and broadcast tensor, 2 (W-1)/W of each all-reduce
    (a reduce-scatter, then an all-gather). An estimate: the backend chooses its own algorithms."""
    if world_size <= 1:
        return 0.0
    share = (world_size - 1) / world_size
    return sum(_RING_FACTOR.get(kind, 1.0) * share * b for kind, b in bytes_by_kind.items())
