"""Small same-shape Muon matrices orthogonalized in one batched Newton-Schulz call (``Muon.ns_batched_matmul =
None``, the default). On a CPU a small matrix's Newton-Schulz is mostly oneDNN's fixed cost per call, which a batch
pays once (kernels/newton_schulz.py has the figures). A batch runs only where the batched call gives each matrix
exactly what it gets alone (:func:`batched_is_exact`, probed), so the results keep torch.optim.Muon's bits and a
sharded run, which batches other sets of matrices, keeps the unsharded run's."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ragged_optim.kernels.newton_schulz import SMALL_BATCH_MAX_MATRICES, batching_pays
from ragged_optim.optim.base import full_shape, local

__all__ = ["PendingMatrix", "SmallMatrixBatch", "SmallMatrixBatches"]


class PendingMatrix(NamedTuple):
    """A whole 2-D Muon param waiting for its batch: its momentum is done, its weight decay and update are not."""

    param: Tensor
    group: dict
    lr: float  # the group's lr as a number (before the shape adjustment)
    decay: float  # the weight decay factor still to apply right before the update (1: none)


class SmallMatrixBatch(NamedTuple):
    ns_kw: dict[str, Any]  # the Newton-Schulz settings, by newton_schulz's names
    updates: Tensor  # [SMALL_BATCH_MAX_MATRICES, m, n] in the ns dtype: the first len(pending) hold the updates
    pending: list[PendingMatrix]


class SmallMatrixBatches:
    """One step's whole, small 2-D Muon params, bucketed by (shape, device, Newton-Schulz settings). Each update is
    cast to the ns dtype into its bucket as it comes (Newton-Schulz's first op is that cast: the same bits), so a
    bucket keeps no fp32 update alive; ``finish(batch)`` runs when a bucket is full and, for the rest, at
    :meth:`finish_all`."""

    def __init__(self, finish: Callable[[SmallMatrixBatch], None], matmul: str) -> None:
        self._finish = finish
        self._matmul = matmul
        self._buckets: dict[tuple, SmallMatrixBatch] = {}

    def add(self, param: Tensor, update: Tensor, group: dict, ns_kw: dict[str, Any], lr: float, decay: float) -> bool:
        """Take ``param``'s ``update`` into its bucket; False when it is not a batchable matrix (its caller finishes
        it alone)."""
        p_local, shape = local(param), full_shape(param)
        if len(shape) != 2 or p_local.numel() != math.prod(shape) or update.numel() != p_local.numel():
            return False  # (a sharded param held whole here has a flat local tensor: viewed as its matrix below)
        if not (p_local.is_contiguous() and update.is_contiguous()):
            return False
        if not batching_pays(*shape, ns_kw["dtype"], update.device, self._matmul):
            return False
        key = (tuple(shape), update.device, *ns_kw.values())
        batch = self._buckets.get(key)
        if batch is None:
            buffer = torch.empty((SMALL_BATCH_MAX_MATRICES, *shape), dtype=ns_kw["dtype"], device=update.device)
            batch = self._buckets[key] = SmallMatrixBatch(ns_kw, buffer, [])
        batch.updates[len(batch.pending)].copy_(update.view(shape))
        batch.pending.append(PendingMatrix(param, group, lr, decay))
        if len(batch.pending) == SMALL_BATCH_MAX_MATRICES:
            self._finish(self._buckets.pop(key))
        return True

    def finish_all(self) -> None:
        while self._buckets:
            self._finish(self._buckets.pop(next(iter(self._buckets))))
