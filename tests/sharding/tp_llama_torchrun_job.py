"""Run by tests/sharding/test_tensor_parallel.py under torchrun (not a test itself): the tiny Llama with torch's TP
plan, ours and FSDP2 + TP and one process, on a (dp=2, tp=2) mesh; each rank saves what it got to argv[1].<rank>."""

import sys

import torch
import torch.distributed as dist
from test_tensor_parallel import _llama_run

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.save(_llama_run(rank, world), f"{sys.argv[1]}.{rank}")
    dist.barrier()
    dist.destroy_process_group()
