"""What the runtime holds and what it sends, on real gloo ranks: params and grads alias the units' flat buffers, a
unit's unsharded buffer is freed before its reduce-scatter and unsharded grads as backward goes, frozen params take
no gradient bytes, and one rank calls no collectives (as FSDP2). Where a test failed on main, its docstring says
why."""

import torch
from adamw_runs import EPS, LR
from fsdp_models import batch, local_rows, loss_fn, make_model, shard

from ragged_optim.comm.counter import count_collectives
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.sharding import fully_shard, units_of


def _zero_copy(rank, world_size):
    model = shard(make_model(), fully_shard)
    checks = []
    for unit in units_of(model):
        shard_ptr = unit.local_shard.untyped_storage().data_ptr()
        checks.append(all(p.to_local().untyped_storage().data_ptr() == shard_ptr for p in unit.sharded_params))
        unit.wait_unshard()
        full_ptr = unit.unsharded.untyped_storage().data_ptr()
        checks.append(all(p.untyped_storage().data_ptr() == full_ptr for p in unit.unsharded_params))
        unit.reshard()
        checks.append(unit.unsharded.untyped_storage().size() == 0)
    x, y = batch(0)
    with count_collectives() as stats:
        loss_fn(model, local_rows(x, rank, world_size), local_rows(y, rank, world_size)).backward()
    grads_alias = all(
        p.grad.to_local().untyped_storage().data_ptr() == u.sharded_grad.untyped_storage().data_ptr()
        for u in units_of(model)
        for p in u.sharded_params
    )
    return checks, grads_alias, dict(stats.calls), len(units_of(model))


def test_params_and_grads_alias_the_flat_buffers():
    checks, grads_alias, calls, n_units = run_on_ranks(_zero_copy, 2)[0]
    assert all(checks) and grads_alias
    # One all-gather per unit in forward, one more per resharded (non-root) unit in backward, one reduce-scatter.
    assert calls["all_gather"] == n_units + (n_units - 1)
    assert calls["reduce_scatter"] == n_units


def _one_rank_step_collectives(rank, world_size, side):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    if side == "ours":
        model = shard(make_model(), fully_shard)
    else:
        model = shard(make_model(), torch_fully_shard, mesh=init_device_mesh("cpu", (world_size,)))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    x, y = batch(0)
    for _ in range(2):  # the second step is counted: nothing left to set up
        with count_collectives() as stats:
            loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad()
    return stats.total_calls


def test_one_rank_calls_no_collectives_as_fsdp2():
    """At world size 1 an all-gather or reduce-scatter is a local copy: no backend call, as in FSDP2 (on an H200's
    NCCL, bench fsdp's GPT made 35 per step where FSDP2 made none). The values: test_sharded_adamw_equals_single_process
    at world size 1."""
    assert run_on_ranks(_one_rank_step_collectives, 1, "fsdp2") == [0]  # the control
    assert run_on_ranks(_one_rank_step_collectives, 1, "ours") == [0]


def _buffers_at_reduce(rank, world_size):
    """For each reduce-scatter issued: bytes of the issuing unit's unsharded buffer still allocated, and whether the
    flat grads of the reduce issued before it are still held by the runtime (a weak reference that is alive)."""
    import gc
    import weakref

    from ragged_optim.sharding import flat_unit as fu
    from ragged_optim.sharding import grad_buckets

    grad_buckets.BUCKET_BYTES = None  # the whole-unit reduce-scatter (GPUs, quantized grads, TP) is the subject here
    model = shard(make_model(n_blocks=3), fully_shard)
    seen, prev = [], []
    to_reduce = fu.FlatUnit._grads_to_reduce

    def grads_to_reduce(self):  # right before the reduce-scatter is issued
        gc.collect()
        seen.append((self.unsharded.untyped_storage().nbytes(), bool(prev) and prev[-1]() is not None))
        full = to_reduce(self)
        prev.append(weakref.ref(full))
        return full

    fu.FlatUnit._grads_to_reduce = grads_to_reduce
    try:
        x, y = batch(0)
        loss_fn(model, local_rows(x, rank, world_size), local_rows(y, rank, world_size)).backward()
    finally:
        fu.FlatUnit._grads_to_reduce = to_reduce
    return seen


def test_a_units_buffers_are_freed_before_its_reduce_scatter():
    """FSDP2's order: a unit's unsharded params are freed before its reduce-scatter allocates the output (before,
    after it: the peak of the backward held both). On CPU gloo copies a reduce-scatter's input when it is issued,
    so the runtime drops its own reference (before, the previous unit's grads were held twice, ours and gloo's,
    through the next unit's backward: W*S bytes)."""
    seen = run_on_ranks(_buffers_at_reduce, 2)[0]
    assert len(seen) == 4
    assert all(nbytes == 0 for nbytes, _ in seen), seen
    assert not any(held for _, held in seen), seen


def _frozen_run(rank, world_size):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out = {}
    for name, fs in [("ours", fully_shard), ("fsdp2", torch_fully_shard)]:
        model = make_model()
        model.emb.weight.requires_grad_(False)  # tied to the head: the largest param of the root unit
        shard(model, fs)
        x, y = batch(0)
        with count_collectives() as stats:
            loss_fn(model, local_rows(x, rank, world_size), local_rows(y, rank, world_size)).backward()
        out[name] = stats.bytes.get("reduce_scatter", 0)
        out[name + "_frozen_grad"] = model.emb.weight.grad
    out["trainable_bytes"] = 4 * sum(p.numel() for n, p in make_model().named_parameters() if n != "emb.weight")
    return out


def test_frozen_params_take_no_gradient_bytes():
    """Main: frozen params stayed in their unit's flat grad buffer and were reduce-scattered as zeros (the frozen
    embedding alone is most of the root unit's bytes). Now they sit in a unit of their own with no grad buffer;
    ours must move no more reduce-scatter bytes than FSDP2, which skips params without grads."""
    out = run_on_ranks(_frozen_run, 3)[0]
    assert out["ours_frozen_grad"] is None
    assert out["ours"] <= out["fsdp2"]
    # what is reduced is the trainable params (padded to the ranks), not the frozen ones
    assert out["ours"] < out["trainable_bytes"] * 1.1


def _grad_buffers_alive(rank, world_size):
    model = shard(make_model(n_blocks=6), fully_shard)
    units = units_of(model)
    alive_counts = []

    def holding():  # units holding a W*S grad buffer: being filled, or read by a reduce-scatter in flight
        return sum(u.grad_buf is not None or u.pending_reduce is not None for u in units)

    def probe(block, x):  # counts during backward, each time the grads of a block's input are done
        x = x.view_as(x)
        x.register_hook(lambda g: alive_counts.append(holding()))
        return block(x)

    model.block_call = probe
    x, y = batch(0)
    loss_fn(model, local_rows(x, rank, world_size), local_rows(y, rank, world_size)).backward()
    return max(alive_counts), holding(), len(units)


def test_unsharded_grads_are_freed_as_backward_goes():
    """Main: every unit's flat grad buffer stayed alive, held by its pending reduce-scatter, until the end of
    backward, so each rank held the whole model's unsharded grads. Now at most three units hold one at a time: the
    root (its reduce-scatter runs at the end: its first input, the token ids, needs no grad), the unit in backward,
    and the one whose reduce-scatter is in flight (docs/runtime.md)."""
    most, after, n_units = run_on_ranks(_grad_buffers_alive, 2)[0]
    assert n_units == 7 and most <= 3 and after == 0
