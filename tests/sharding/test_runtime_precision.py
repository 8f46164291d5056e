"""Mixed precision on real gloo ranks: bf16 compute keeps fp32 master params and grads, fp16 grads near overflow are
averaged without overflowing, and micro-batches without gradient sync accumulate in the reduce dtype, against one
process and torch FSDP2. Where a test failed on main, its docstring says why."""

import copy

import torch
from adamw_runs import EPS, LR, max_diff, single_run
from fsdp_models import batch, local_rows, loss_fn, make_model, shard
from noise_bounds import allowed, assert_within_reference, magnitude
from torch import nn

from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.sharding import full_grad, full_tensor, fully_shard


def _mixed_precision(rank, world_size):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shard(make_model(), fully_shard, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    dtypes = {p.dtype for p in model.parameters()}
    for step in range(2):
        x, y = batch(step)
        loss_fn(model, local_rows(x, rank, world_size), local_rows(y, rank, world_size)).backward()
        grad_dtypes = {p.grad.dtype for p in model.parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return dtypes, grad_dtypes, {n: full_tensor(p) for n, p in model.named_parameters()}


def single_run_bf16_compute(steps, world_size):
    """One process, what MixedPrecisionPolicy(bf16 params, fp32 reduce) does: each rank's rows go through a bf16
    copy of the fp32 master params; the bf16 grads, cast to fp32, are averaged; AdamW steps the fp32 masters."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    for step in range(steps):
        x, y = batch(step)
        for rank in range(world_size):
            low = copy.deepcopy(model).to(torch.bfloat16)
            loss_fn(low, local_rows(x, rank, world_size), local_rows(y, rank, world_size)).backward()
            for p, q in zip(model.parameters(), low.parameters()):
                g = q.grad.float() / world_size
                p.grad = g if p.grad is None else p.grad + g
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_mixed_precision_keeps_fp32_master_params():
    dtypes, grad_dtypes, params = run_on_ranks(_mixed_precision, 2)[0]
    assert dtypes == {torch.float32} and grad_dtypes == {torch.float32}
    # The reference runs each rank's rows through the same bf16 kernels with one thread, as each rank does (bf16
    # GEMMs may split their sums by thread count); the 2-term fp32 grad sum is then the only other difference, and
    # a + b == b + a: so nothing but float32 ulps is allowed (measured: 0.0).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = single_run_bf16_compute(steps=2, world_size=2)
    finally:
        torch.set_num_threads(threads)
    assert_within_reference(max_diff(params, ref), 0.0, magnitude(ref), "bf16 compute, 2 ranks")
    # and bf16 compute really ran: far from the fp32 run, by 100x more than two fp32 batchings differ
    fp32 = single_run(steps=2, world_size=2)
    fp32_noise = max_diff(single_run(steps=2, world_size=2, one_batch=True), fp32)
    assert max_diff(params, fp32) > 100 * fp32_noise


def _fp16_reduce(rank, world_size):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)
    model = nn.Linear(4, 4, bias=False)
    fully_shard(model, mp_policy=mp)
    x = torch.full((1, 4), 30000.0)  # every rank's weight grad is 30000 in every element: fp16 max is 65504
    model(x).sum().backward()
    return full_grad(model.weight)


def test_fp16_gradients_near_overflow_are_averaged_without_overflow():
    """Main: the reduce-scatter summed fp16 grads, then divided: 4 x 30000 overflowed to inf. Now the division is
    split around the sum (FSDP's pre/post factors), so the mean of equal grads comes back exactly."""
    grad = run_on_ranks(_fp16_reduce, 4)[0]
    assert torch.equal(grad, torch.full((4, 4), 30000.0))


def _bf16_accumulation(rank, world_size, micro=8):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out = {}
    for name, fs in [("ours", fully_shard), ("fsdp2", torch_fully_shard)]:
        model = shard(make_model(), fs, mp_policy=mp)
        x, y = batch(0, n=8 * micro * world_size)
        xs, ys = local_rows(x, rank, world_size), local_rows(y, rank, world_size)
        for i, (xm, ym) in enumerate(zip(xs.chunk(micro), ys.chunk(micro))):
            model.set_requires_gradient_sync(i == micro - 1)
            (loss_fn(model, xm, ym) / micro).backward()
        out[name] = [full_grad(p) for p in model.parameters()]
    return out


def _one_process_bf16_grads(world_size, micro=8, accumulate_in=torch.float32, reverse=False):
    """bf16 compute per micro-batch (as mp_policy does), grads summed in ``accumulate_in``."""
    model = make_model().to(torch.bfloat16)
    x, y = batch(0, n=8 * micro * world_size)
    total = [torch.zeros(p.shape, dtype=accumulate_in) for p in model.parameters()]
    chunks = [(r, i) for r in range(world_size) for i in range(micro)]
    for r, i in chunks[::-1] if reverse else chunks:
        xm, ym = local_rows(x, r, world_size).chunk(micro)[i], local_rows(y, r, world_size).chunk(micro)[i]
        grads = torch.autograd.grad(loss_fn(model, xm, ym) / micro, list(model.parameters()))
        for t, g in zip(total, grads):
            t += g.to(accumulate_in)
    return [(t / world_size).float() for t in total]


def _gdist(a, b):
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(a, b))


def test_no_sync_accumulates_in_the_reduce_dtype():
    """Main: without gradient sync, bf16 grads accumulated in the bf16 flat buffer; FSDP2 upcasts them to
    reduce_dtype and accumulates there. Ours must be as close to an fp32-accumulated reference as FSDP2 is (up to
    4x its distance, or the distance of the same sum taken in another order), far from a bf16-accumulated one."""
    r = run_on_ranks(_bf16_accumulation, 2)[0]
    ref = _one_process_bf16_grads(2)
    noise = max(_gdist(r["fsdp2"], ref), _gdist(_one_process_bf16_grads(2, reverse=True), ref))
    bf16_error = _gdist(_one_process_bf16_grads(2, accumulate_in=torch.bfloat16), ref)
    assert _gdist(r["ours"], ref) <= allowed(noise, 1.0) < bf16_error  # relative gaps: ulps of 1
