"""count_collectives: every kind of collective is counted once, with the message bytes the module docstring
defines, whether called in tensor or list form."""

import torch
import torch.distributed as dist

from ragged_optim.comm.counter import count_collectives
from ragged_optim.comm.launch import run_on_ranks


def _issue_each_kind(rank, world_size):
    n = 3  # fp32 elements per rank's piece: 12 bytes
    with count_collectives() as stats:
        dist.all_gather_into_tensor(torch.zeros(n * world_size), torch.ones(n))
        dist.reduce_scatter_tensor(torch.zeros(n), torch.ones(n * world_size))
        dist.all_to_all_single(torch.zeros(n * world_size), torch.ones(n * world_size))
        dist.all_reduce(torch.ones(n))
        dist.broadcast(torch.ones(n), src=0)
        dist.all_gather([torch.zeros(n) for _ in range(world_size)], torch.ones(n))
        dist.all_to_all([torch.zeros(n) for _ in range(world_size)], [torch.ones(n) for _ in range(world_size)])
        dist.reduce_scatter(torch.zeros(n), [torch.ones(n) for _ in range(world_size)])
    return stats.as_dict()


def test_every_kind_counted_once_with_its_bytes():
    W, piece = 2, 12
    stats = run_on_ranks(_issue_each_kind, W)[0]
    assert stats["calls"] == {"all_gather": 2, "reduce_scatter": 2, "all_to_all": 2, "all_reduce": 1, "broadcast": 1}
    assert stats["bytes"] == {
        "all_gather": 2 * W * piece,  # the gathered output
        "reduce_scatter": 2 * W * piece,  # the full input
        "all_to_all": 2 * W * piece,  # the full input
        "all_reduce": piece,
        "broadcast": piece,
    }
