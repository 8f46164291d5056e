"""Quantized communication: per-rank quantization equals quantizing after the gather, bit for bit."""

import torch
from fsdp_models import batch, local_rows, loss_fn, make_model, shard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from ragged_optim.comm.counter import count_collectives
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.comm.quantized import pack, unpack
from ragged_optim.sharding import CommPolicy, QuantizedAllGather, fully_shard, units_of


def _gather_both_ways(rank, world_size, shapes, fmt, block_size):
    torch.manual_seed(0)
    model = nn.ParameterList([nn.Parameter(torch.randn(*s) * (i + 1)) for i, s in enumerate(shapes)])
    fully_shard(model, comm_policy=QuantizedAllGather(fmt, block_size))
    unit = units_of(model)[0]
    unit.wait_unshard()
    quantized_per_rank = unit.unsharded.clone()
    full_master = unit._gather_master()  # exact fp32 values, laid out like the flat buffer
    flat = torch.zeros(unit.layout.total_size)
    for i, t in enumerate(full_master):
        off = unit.layout.offsets[i]
        flat[off : off + t.numel()] = t.reshape(-1)
    after_gather = unpack(pack(flat, block_size, fmt), flat.numel(), block_size, fmt, torch.empty_like(flat))
    return quantized_per_rank, after_gather, flat


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    shapes=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30)), min_size=1, max_size=4),
    world_size=st.integers(1, 5),
    fmt=st.sampled_from(["int8", "fp8_e4m3"]),
    block_size=st.sampled_from([4, 32, 128]),
)
def test_per_rank_quantization_equals_quantizing_after_gather(shapes, world_size, fmt, block_size):
    per_rank, after, exact = run_on_ranks(_gather_both_ways, world_size, shapes, fmt, block_size)[0]
    assert torch.equal(per_rank, after)
    if fmt == "int8":  # the block error bound: |x - q(x)| <= absmax / 254
        err = (per_rank - exact).abs().view(-1, block_size)
        bound = exact.abs().view(-1, block_size).amax(dim=1, keepdim=True) / 254
        assert bool((err <= bound * (1 + 1e-6)).all())


def _train(rank, world_size, policy, steps):
    model = shard(make_model(), fully_shard, comm_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    with count_collectives() as stats:
        for step in range(steps):
            x, y = batch(step % 4)
            loss = loss_fn(model, local_rows(x, rank, world_size), local_rows(y, rank, world_size))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, dict(stats.bytes)


def test_int8_training_tracks_full_precision_and_cuts_bytes():
    full, full_bytes = run_on_ranks(_train, 2, CommPolicy(), 30)[0]
    q, q_bytes = run_on_ranks(_train, 2, CommPolicy("int8", "int8", 128), 30)[0]
    assert full[-1] < full[0] * 0.8  # it learns
    assert abs(q[-1] - full[-1]) / full[-1] < 0.01
    ratio = (q_bytes["all_gather"] + q_bytes["all_to_all"]) / (full_bytes["all_gather"] + full_bytes["reduce_scatter"])
    assert ratio < 0.27, ratio


def test_bf16_grad_reduce_halves_the_reduce_scatter_bytes():
    b16_losses, b16 = run_on_ranks(_train, 2, CommPolicy(grad_reduce="bf16"), 3)[0]
    f32_losses, f32 = run_on_ranks(_train, 2, CommPolicy(), 3)[0]
    assert b16["reduce_scatter"] * 2 == f32["reduce_scatter"]
    assert abs(b16_losses[-1] - f32_losses[-1]) < 1e-2 * f32_losses[-1]
