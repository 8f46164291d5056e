"""Flat collectives over a ProcessGroup, on the non-deprecated torch names where this torch has them.

Every function looks up ``torch.distributed`` at call time, so ``count_collectives`` sees them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False):
    """Gather each rank's ``shard`` (S elements) into ``output`` (W*S elements, rank order), in place."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, shard, group=group, async_op=async_op)


def reduce_scatter_flat(shard_out: torch.Tensor, full: torch.Tensor, group=None, async_op: bool = False):
    """Sum ``full`` (W*S elements) across ranks and write this rank's S-element slice into ``shard_out``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(shard_out, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_to_all_flat(output: torch.Tensor, input: torch.Tensor, out_splits, in_splits, group=None):
    """One all_to_all_single with per-rank split sizes (elements); empty splits are allowed."""
    return dist.all_to_all_single(
        output, input, output_split_sizes=list(out_splits), input_split_sizes=list(in_splits), group=group
    )
