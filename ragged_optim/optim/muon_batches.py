"""Small same-shape Muon matrices orthogonalized in one batched Newton-Schulz call (``Muon.ns_batched_matmul =
None``, the default). On a CPU a small matrix's Newton-Schulz is mostly oneDNN's fixed cost per call, which a batch
pays once (kernels/newton_schulz.py has the figures). A batch runs only where the batched call gives each matrix
exactly what it gets alone (:func:`batched_is_exact`, probed), so the results keep torch.optim.Muon's bits and a
sharded run, which batches other sets of matrices, keeps the unsharded run's."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from torch import Tensor

from ragged_optim.kernels.newton_schulz import SMALL_BATCH_MAX_BYTES, SMALL_BATCH_MAX_MATRICES, batching_pays
from ragged_optim.optim.base import full_shape, local

if TYPE_CHECKING:
    from ragged_optim.optim.muon import NewtonSchulzSettings

__all__ = ["PendingMatrix", "SmallMatrixBatch", "SmallMatrixBatches"]


class PendingMatrix(NamedTuple):
    """A whole 2-D Muon param waiting for its batch: its momentum is done, its weight decay and update are not."""

    param: Tensor
    group: dict
    lr: float  # the group's lr as a number (before the shape adjustment)
    decay: float  # the weight decay factor still to apply right before the update (1: none)


class SmallMatrixBatch(NamedTuple):
    ns: NewtonSchulzSettings  # the bucket's Newton-Schulz settings
    slots: Tensor  # [k, m, n] in the ns dtype, k = the matrices this batch expects: the first len(pending) are set
    pending: list[PendingMatrix]

    @property
    def updates(self) -> Tensor:
        """The pending params' updates, as matrices in the ns dtype."""
        return self.slots[: len(self.pending)]


class SmallMatrixBatches:
    """One step's whole, small 2-D Muon params, bucketed by (shape, device, Newton-Schulz settings).

    :meth:`plan` counts each bucket's params before the step changes anything: a matrix whose shape no other shares
    is not batched, and a bucket is finished (``finish(batch)``) as soon as its last param or its
    :data:`SMALL_BATCH_MAX_MATRICES`-th arrives, so nothing waits longer than its batch needs. Each update waits cast
    to the ns dtype (Newton-Schulz's first op is that cast: the same bits), in slots made when its bucket opens; when
    the open buckets' slots would pass :data:`SMALL_BATCH_MAX_BYTES` the fullest bucket goes first: what waits is at
    most one full batch of the largest batchable matrix, whatever the model."""

    def __init__(self, finish: Callable[[SmallMatrixBatch], None], matmul: str) -> None:
        self._finish = finish
        self._matmul = matmul
        self._key_of: dict[int, tuple] = {}
        self._left: Counter = Counter()
        self._buckets: dict[tuple, SmallMatrixBatch] = {}
        self._bytes = 0

    def plan(self, params: list[Tensor], grads: list[Tensor], ns: NewtonSchulzSettings) -> None:
        """Count one Muon group's batchable params (call for every group before the first :meth:`add`)."""
        for p, g in zip(params, grads):
            p_local, shape = local(p), full_shape(p)
            if len(shape) != 2 or p_local.numel() != math.prod(shape) or g.numel() != p_local.numel():
                continue  # (a sharded param held whole here has a flat local tensor: viewed as its matrix in add)
            if not (p_local.is_contiguous() and batching_pays(*shape, ns.dtype, g.device, self._matmul)):
                continue
            key = (tuple(shape), g.device, ns)
            self._key_of[id(p)] = key
            self._left[key] += 1
        for key in [k for k, n in self._left.items() if n == 1]:  # nothing to share a batch with
            del self._left[key]

    def add(
        self, param: Tensor, update: Tensor, group: dict, ns: NewtonSchulzSettings, lr: float, decay: float
    ) -> bool:
        """Take ``param``'s ``update`` into its bucket; False when it is not batched (its caller finishes it alone)."""
        key = self._key_of.get(id(param))
        if key is None or not self._left[key]:
            return False
        self._left[key] -= 1
        if not update.is_contiguous():  # (not seen: the update is made like the grad)
            self._flush_if_done(key)
            return False
        batch = self._buckets.get(key)
        if batch is None:  # slots for the params still to come (counted by plan), up to one full batch
            one = update.numel() * ns.dtype.itemsize
            k = min(self._left[key] + 1, SMALL_BATCH_MAX_MATRICES, max(1, SMALL_BATCH_MAX_BYTES // one))
            size = k * one
            while self._buckets and self._bytes + size > SMALL_BATCH_MAX_BYTES:
                self._pop(max(self._buckets, key=lambda b: len(self._buckets[b].pending)))
            slots = update.new_empty((k, *key[0]), dtype=ns.dtype)
            batch = self._buckets[key] = SmallMatrixBatch(ns, slots, [])
            self._bytes += size
        batch.slots[len(batch.pending)].copy_(update.view(key[0]))
        batch.pending.append(PendingMatrix(param, group, lr, decay))
        self._flush_if_done(key)
        return True

    def finish_all(self) -> None:
        while self._buckets:
            self._pop(next(iter(self._buckets)))

    def _flush_if_done(self, key: tuple) -> None:
        batch = self._buckets.get(key)
        if batch is not None and (not self._left[key] or len(batch.pending) == len(batch.slots)):
            self._pop(key)

    def _pop(self, key: tuple) -> None:
        batch = self._buckets.pop(key)
        self._bytes -= batch.slots.numel() * batch.slots.element_size()
        self._finish(batch)
