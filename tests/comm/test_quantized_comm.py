"""Quantized communication: per-rank quantization equals quantizing after the gather, bit for bit; training with
int8 or bf16 on the wire stays as close to full precision as the same rounding simulated in one process."""

import torch
from fsdp_models import batch, local_rows, loss_fn, make_model, shard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from noise_bounds import assert_within_reference, magnitude, max_abs_gap
from torch import nn

from ragged_optim.comm.counter import count_collectives
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.comm.quantized import pack, unpack
from ragged_optim.sharding import CommPolicy, QuantizedAllGather, full_tensor, fully_shard, units_of
from ragged_optim.sharding.unit_collectives import gather_master


def _gather_both_ways(rank, world_size, shapes, fmt, block_size):
    torch.manual_seed(0)
    model = nn.ParameterList([nn.Parameter(torch.randn(*s) * (i + 1)) for i, s in enumerate(shapes)])
    fully_shard(model, comm_policy=QuantizedAllGather(fmt, block_size))
    unit = units_of(model)[0]
    unit.wait_unshard()
    quantized_per_rank = unit.unsharded.clone()
    full_master = gather_master(unit)  # exact fp32 values, laid out like the flat buffer
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
    params = {n: full_tensor(p).detach().clone() for n, p in model.named_parameters()}  # every rank: collectives
    return losses, dict(stats.bytes), params


def _int8(t: torch.Tensor, block_size: int) -> torch.Tensor:
    """Symmetric int8 rounding in blocks of ``block_size`` of the flat tensor (scale = block absmax / 127), written
    out here rather than through the library's pack/unpack."""
    flat = t.detach().reshape(-1).float()
    n = flat.numel()
    blocks = torch.nn.functional.pad(flat, (0, -n % block_size)).view(-1, block_size)
    scale = blocks.abs().amax(dim=1, keepdim=True) / 127
    q = torch.where(scale > 0, (blocks / scale).round().clamp(-127, 127) * scale, torch.zeros_like(blocks))
    return q.reshape(-1)[:n].view_as(t)


def _one_process(steps, round_params=None, round_grads=None, world_size=2):
    """The same training in one process, with the wire's rounding simulated here: each forward sees
    ``round_params(p)`` of every param (the master values stay exact), and the grad is the mean of the
    ``round_grads`` of each rank's micro-batch grad (a rank rounds its partial sum before the reduce, where
    cancellation between ranks can leave a small sum with a large relative error). Its distance from the same run
    without rounding is that rounding's effect on this training: the reference a sharded run with the same rounding
    on the wire is held to (other block boundaries, a sum in another order: not bit for bit). One thread, as the
    ranks run (several threads on a busy 2-core machine are ten times slower here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_one_process(steps, round_params, round_grads, world_size)
    finally:
        torch.set_num_threads(threads)


def _train_one_process(steps, round_params, round_grads, world_size):
    model = make_model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3)
    losses = []
    for step in range(steps):
        x, y = batch(step % 4)
        masters = [p.detach().clone() for p in params]
        if round_params is not None:
            with torch.no_grad():
                for p in params:
                    p.copy_(round_params(p))
        grads, loss = [torch.zeros_like(p) for p in params], 0.0
        for r in range(world_size):
            part = loss_fn(model, local_rows(x, r, world_size), local_rows(y, r, world_size))
            for g, d in zip(grads, torch.autograd.grad(part, params)):
                g += d if round_grads is None else round_grads(d)
            loss += part.item() / world_size
        with torch.no_grad():
            for p, m, g in zip(params, masters, grads):
                p.copy_(m)
                p.grad = g / world_size
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_rounding_effect_within_reference(ours, exact, sim, sim_exact, what):
    """The gap that rounding on the wire makes (params after training, and the loss at every step) is within
    FACTOR x the gap the same rounding simulated in one process makes, measured in this run."""
    (q_losses, q_params), (f_losses, f_params) = ours, exact
    (s_losses, s_params), (e_losses, e_params) = sim, sim_exact
    assert_within_reference(
        max_abs_gap(q_params, f_params), max_abs_gap(s_params, e_params), magnitude(f_params), f"{what} (params)"
    )
    loss_gap = max(abs(a - b) for a, b in zip(q_losses, f_losses))
    ref_gap = max(abs(a - b) for a, b in zip(s_losses, e_losses))
    assert_within_reference(loss_gap, ref_gap, max(f_losses), f"{what} (losses)")


def test_int8_training_tracks_full_precision_and_cuts_bytes():
    """int8 params on the all-gather and int8 grads on the reduce (block 128): the training's distance from the
    full-precision run is int8 rounding's effect, bounded by the same rounding simulated in one process."""
    steps, block = 30, 128
    full, full_bytes, full_params = run_on_ranks(_train, 2, CommPolicy(), steps)[0]
    q, q_bytes, q_params = run_on_ranks(_train, 2, CommPolicy("int8", "int8", block), steps)[0]
    assert full[-1] < full[0] * 0.8 and q[-1] < q[0] * 0.8  # both learn
    exact = _one_process(steps)
    sim = _one_process(steps, lambda p: _int8(p, block), lambda g: _int8(g, block))
    _assert_rounding_effect_within_reference((q, q_params), (full, full_params), sim, exact, "int8 wire vs fp32")
    ratio = (q_bytes["all_gather"] + q_bytes["all_to_all"]) / (full_bytes["all_gather"] + full_bytes["reduce_scatter"])
    assert ratio < 0.27, ratio


def test_bf16_grad_reduce_halves_the_reduce_scatter_bytes():
    """bf16 grads on the reduce-scatter: the distance from the fp32 run is bf16 rounding of the grads, bounded by
    the same rounding simulated in one process."""
    b16_losses, b16, b16_params = run_on_ranks(_train, 2, CommPolicy(grad_reduce="bf16"), 3)[0]
    f32_losses, f32, f32_params = run_on_ranks(_train, 2, CommPolicy(), 3)[0]
    assert b16["reduce_scatter"] * 2 == f32["reduce_scatter"]
    exact = _one_process(3)
    sim = _one_process(3, round_grads=lambda g: g.bfloat16().float())
    _assert_rounding_effect_within_reference(
        (b16_losses, b16_params), (f32_losses, f32_params), sim, exact, "bf16 grad reduce vs fp32"
    )
