"""Checks that every rank of a process group holds the same thing before a collective relies on it.

A mismatch (a model built differently on one rank, an EP layout with different expert counts on ranks of one
``fully_shard`` mesh) would otherwise surface as a gloo abort or a hang inside the first all-gather. One all_reduce of
a digest per check; only on a mismatch are the descriptions gathered, so every rank raises the same error naming the
first difference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ragged_optim.comm.collectives import same_on_every_rank, serves_cuda


def first_difference(group, device: torch.device, desc: list) -> str | None:
    """None when ``desc`` (a list of picklable entries) is the same on every rank of ``group``; else where the
    first rank that differs from rank 0 of the group differs, as ``"entry i: A on rank 0 but B on rank r"``."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None
    if same_on_every_rank(repr(desc), group, device):
        return None
    descs = [None] * dist.get_world_size(group)
    dist.all_gather_object(descs, desc, group=group)
    r = next(k for k, d in enumerate(descs) if d != descs[0])
    a, b = descs[0], descs[r]
    i = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), None)
    if i is None:
        extra = (a if len(a) > len(b) else b)[min(len(a), len(b))]
        return f"{len(a)} entries on rank 0 of the group but {len(b)} on rank {r}, the first extra one {_short(extra)}"
    return f"entry {i}: {_short(a[i])} on rank 0 of the group but {_short(b[i])} on rank {r}"


def _short(entry, limit: int = 240) -> str:
    text = repr(entry)
    return text if len(text) <= limit else text[: limit - 5] + " ...)"


def check_device(group, device: torch.device) -> torch.device:
    """A device ``group``'s collectives take for a check: ``device`` unless that is meta (the params are not
    materialized yet), then the current CUDA device on NCCL and the CPU otherwise."""
    if device.type != "meta":
        return device
    return torch.device("cuda", torch.cuda.current_device()) if serves_cuda(group) else torch.device("cpu")
