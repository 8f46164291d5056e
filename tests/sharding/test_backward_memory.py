"""Our backward holds no more than FSDP2's, counted exactly (issue 39, part 2). On main a whole unit more stayed
alive through the blocks' backward: on a CPU the previous unit's reduce-scatter was left in flight, and gloo's
worker copies its input and keeps the copy until its next work (FSDP2 waits for it at once there). This test fails
there (ours 3.73 MB against FSDP2's 3.21 MB, one unit 0.53 MB). The other cause, a zero-filled flat gradient
buffer of the running unit made at its pre-backward, shows on bigger units (bench memory, bench50m: 8 MB of the
gap) and not in this model's peak."""

import gc

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import ragged_optim as ro
from ragged_optim import alloc_counter
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.memory import peak_bytes, settle

WIDTH, BLOCKS = 256, 6


@pytest.fixture(scope="module", autouse=True)
def counter():
    alloc_counter.install()  # built once; the forked ranks inherit it installed


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH)) for _ in range(BLOCKS)]
        )

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def backward_peaks(rank, world):
    out = {}
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(rank))
    for kind, shard in (("fsdp2", torch_fully_shard), ("ours", ro.fully_shard), ("fsdp2_again", torch_fully_shard)):
        model = Stack()
        for b in model.blocks:
            shard(b)
        shard(model)
        model(x).square().mean().backward()  # a first step: lazy init, gloo's buffers
        for p in model.parameters():
            p.grad = None
        gc.collect()
        settle()
        _, peak = peak_bytes(lambda model=model: model(x).square().mean().backward())
        out[kind] = peak
        del model
        gc.collect()
        settle()
    return out


def test_backward_peak_is_no_higher_than_fsdp2s():
    unit = 2 * (WIDTH * WIDTH + WIDTH) * 4  # one block's params, fp32: the size of what main held extra
    for got in run_on_ranks(backward_peaks, 2):
        fsdp2 = max(got["fsdp2"], got["fsdp2_again"])  # (FSDP2's own figure moves with gloo's copy: both runs)
        assert got["ours"] <= fsdp2 + unit // 2, (got, unit)
