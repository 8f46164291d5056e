"""A small training run on our sharding, shared by the communication benchmarks: time, bytes and loss per config."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ragged_optim.comm.counter import CommStats, count_collectives
from ragged_optim.data import get_batch
from ragged_optim.models import build_model


def train_config(rank, world_size, cfg, steps, batch_size, lr, shard_fn, seed=0) -> dict:
    """Train ``steps`` AdamW steps of the GPT ``cfg`` sharded by ``shard_fn(model)`` on this rank. Returns the
    mean loss over ranks per step, the median step time (barrier-synchronised), collective calls and bytes per
    step (this rank), and the full params at the end."""
    from ragged_optim.sharding import full_tensor

    model = build_model(cfg, seed=seed)
    shard_fn(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses, times, comm = [], [], CommStats()
    for step in range(steps):
        x, y = get_batch("train", batch_size, cfg.seq_len, step, rank, world_size, seed)
        dist.barrier()
        t0 = time.perf_counter()
        with count_collectives() as stats:
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        comm.add(stats)
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / world_size)
    return {
        "losses": losses,
        "step_s": sorted(times[1:] or times)[len(times[1:] or times) // 2],  # median, first step excluded
        "calls_per_step": comm.total_calls / steps,
        "bytes_per_step": comm.total_bytes / steps,
        "comm": {k: v / steps for k, v in comm.bytes.items()},
        "params": {n: full_tensor(p).clone() for n, p in model.named_parameters()},
    }


def final_loss(losses: list[float], window: int = 10) -> float:
    """Mean of the last ``window`` losses: one step's loss is noisy."""
    tail = losses[-window:]
    return sum(tail) / len(tail)
