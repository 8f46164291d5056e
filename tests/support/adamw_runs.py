"""The runtime tests' AdamW training run on ragged-sharded ranks and its one-process reference (imported by the
runtime and HSDP tests; not a test itself)."""

import torch
from fsdp_models import batch, local_rows, loss_fn, make_model, shard
from noise_bounds import assert_within_reference, magnitude

from ragged_optim.sharding import clip_grad_norm_, full_tensor, fully_shard

STEPS = 3
# AdamW turns an absolute grad difference d on a grad much smaller than eps into lr*d/eps of param difference.
# fp32 sums in another order (gloo's ring vs one process) differ by d ~ 1e-10 on O(1e-3) grads, so with torch's
# default eps=1e-8 and lr=1e-3 that alone is ~1e-5. These settings keep the comparison about the runtime: a wrong
# grad slice still moves params by ~lr = 1e-4, far above the allowed gap. test_grads_match checks grads directly.
# The allowed gap is measured in each test (tests/support/noise_bounds.py): the one-process run batched another way.
LR = 1e-4
EPS = 1e-6


def single_run(steps=STEPS, world_size=1, clip=None, one_batch=False):
    """The one-process reference. Each rank's rows are a micro-batch here too: the global grad is then the same
    sum in nearly the same order, and AdamW (which normalises by sqrt(v)) does not amplify last-bit differences of
    near-zero grads into visible ones. ``one_batch``: the same rows as one batch, the same math summed in another
    order: its gap to the micro-batched run is the rounding noise the sharded run is allowed."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    for step in range(steps):
        x, y = batch(step)
        if one_batch:
            rows = x.shape[0] // world_size * world_size
            loss_fn(model, x[:rows], y[:rows]).backward()
        for rank in range(0 if one_batch else world_size):
            xs, ys = local_rows(x, rank, world_size), local_rows(y, rank, world_size)
            (loss_fn(model, xs, ys) / world_size).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def sharded_run(rank, world_size, steps=STEPS, reshard_after_forward=True, accumulate=1, clip=None):
    model = shard(make_model(), fully_shard, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    norms = []
    for step in range(steps):
        x, y = batch(step)
        x, y = local_rows(x, rank, world_size), local_rows(y, rank, world_size)
        chunks = list(zip(x.chunk(accumulate), y.chunk(accumulate)))
        for i, (xs, ys) in enumerate(chunks):
            model.set_requires_gradient_sync(i == len(chunks) - 1)
            (loss_fn(model, xs, ys) / accumulate).backward()
        if clip is not None:
            norms.append(float(clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return {n: full_tensor(p).clone() for n, p in model.named_parameters()}, norms


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_matches_single(params, world_size, what, **kw):
    """``params`` within rounding noise of the one-process run: the gap allowed is measured here, as the gap
    between two batchings of the one-process run (tests/support/noise_bounds.py)."""
    ref = single_run(world_size=world_size, **kw)
    other = single_run(world_size=world_size, one_batch=True, **kw)
    assert_within_reference(max_diff(params, ref), max_diff(other, ref), magnitude(ref), what)
