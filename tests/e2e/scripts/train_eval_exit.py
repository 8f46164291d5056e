"""A user's script under torchrun: train, evaluate under no_grad, destroy the process group, end. No teardown code.

torchrun --nproc-per-node 2 tests/e2e/scripts/train_eval_exit.py ours|fsdp2
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "support"))
from fsdp_models import batch, local_rows, loss_fn, make_model, shard  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if sys.argv[1] == "ours":
    from ragged_optim import fully_shard
else:
    from torch.distributed.fsdp import fully_shard
model = shard(make_model(), fully_shard)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    x, y = batch(step)
    loss_fn(model, local_rows(x, rank, world), local_rows(y, rank, world)).backward()
    opt.step()
    opt.zero_grad()
model.eval()
with torch.no_grad():
    x, y = batch(9)
    loss_fn(model, local_rows(x, rank, world), local_rows(y, rank, world))
dist.destroy_process_group()
