"""RaggedShard runtime on real gloo ranks: sharded training equals the one-process run."""

import copy

import pytest
import torch
from adamw_runs import EPS, LR, assert_matches_single, max_diff, sharded_run, single_run
from fsdp_models import batch, local_rows, loss_fn, make_model, shard
from noise_bounds import allowed, assert_within_reference, magnitude, max_rel_gap

from ragged_optim.comm.counter import count_collectives
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.sharding import (
    clip_grad_norm_,
    full_tensor,
    fully_shard,
    get_full_state_dict,
    load_full_state_dict,
    shard_info,
    units_of,
)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_sharded_adamw_equals_single_process(world_size, reshard_after_forward):
    params, _ = run_on_ranks(sharded_run, world_size, reshard_after_forward=reshard_after_forward)[0]
    assert_matches_single(params, world_size, f"AdamW, {world_size} ranks")


def _accumulation_collectives(rank, world_size, accumulate=3):
    model = shard(make_model(), fully_shard)
    x, y = batch(0)
    chunks = list(
        zip(local_rows(x, rank, world_size).chunk(accumulate), local_rows(y, rank, world_size).chunk(accumulate))
    )
    reduce_scatters = []
    for i, (xs, ys) in enumerate(chunks):
        model.set_requires_gradient_sync(i == len(chunks) - 1)
        with count_collectives() as stats:
            (loss_fn(model, xs, ys) / accumulate).backward()
        reduce_scatters.append(stats.calls.get("reduce_scatter", 0))
    return reduce_scatters, len(units_of(model))


def test_gradient_accumulation_equals_large_batch():
    params, _ = run_on_ranks(sharded_run, 2, accumulate=3)[0]
    assert_matches_single(params, 2, "3 accumulated micro-batches, 2 ranks")
    # and the first micro-batches really skip the reduce-scatter: only the last one syncs, once per unit
    reduce_scatters, n_units = run_on_ranks(_accumulation_collectives, 2)[0]
    assert reduce_scatters == [0, 0, n_units]


def test_clip_grad_norm_is_global():
    params, norms = run_on_ranks(sharded_run, 3, clip=0.5)[0]
    assert_matches_single(params, 3, "clipped, 3 ranks", clip=0.5)
    assert all(n > 0.5 for n in norms)  # the clip was active, so the global norm mattered


def _grads(rank, world_size):
    """Our full grads, and torch FSDP2's for the same model and rows (the control: the same sums in gloo)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from ragged_optim.sharding import full_grad

    x, y = batch(0)
    out = []
    for shard_fn in (fully_shard, torch_fully_shard):
        model = shard(make_model(), shard_fn)
        loss_fn(model, local_rows(x, rank, world_size), local_rows(y, rank, world_size)).backward()
        out.append({n: full_grad(p) for n, p in model.named_parameters()})
    return out


def _single_grads(world_size, one_batch=False):
    model = make_model()
    x, y = batch(0)
    if one_batch:
        rows = x.shape[0] // world_size * world_size
        loss_fn(model, x[:rows], y[:rows]).backward()
    else:
        for rank in range(world_size):
            (loss_fn(model, local_rows(x, rank, world_size), local_rows(y, rank, world_size)) / world_size).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world_size", [3, 5])
def test_grads_match_single_process(world_size):
    ref = _single_grads(world_size)
    ours, fsdp2 = run_on_ranks(_grads, world_size)[0]
    # Relative to each grad's largest entry. The allowed gap: the larger of FSDP2's (the same reduce-scatter) and
    # the one-process run's with the rows as one batch (the same sum in another order), both measured here.
    reference = max(max_rel_gap(fsdp2, ref), max_rel_gap(_single_grads(world_size, one_batch=True), ref))
    assert_within_reference(max_rel_gap(ours, ref), reference, 1.0, f"grads, {world_size} ranks")


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


class _Scale(torch.nn.Module):
    """A unit of 3 elements: over 8 ranks, most ranks own nothing of it at all."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, 0.5, 2.0]))

    def forward(self, x):
        return x * self.w.mean()


class _WithTinyUnit(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = make_model(n_blocks=1)
        self.scale = _Scale()

    def forward(self, idx):
        return self.scale(self.body(idx))


def _tiny_unit_steps(rank, world_size):
    model = _WithTinyUnit()
    fully_shard(model.body.layers[0])
    fully_shard(model.scale)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    owned = {}
    for u in units_of(model):
        for p in u.sharded_params:
            lo, hi = shard_info(p).local_range
            owned[id(p)] = hi - lo
    scale_owned = owned[id(model.scale.w)]
    gain_owned = owned[id(model.body.layers[0].gain)]
    for step in range(2):
        x, y = batch(step, n=16)  # 2 rows per rank
        loss_fn(model, local_rows(x, rank, world_size), local_rows(y, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()
    return scale_owned, gain_owned, {n: full_tensor(p) for n, p in model.named_parameters()}


def _tiny_unit_one_process(micro_batches=1):
    model = _WithTinyUnit()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x, y = batch(step, n=16)
        for i in range(micro_batches):
            xs, ys = local_rows(x, i, micro_batches), local_rows(y, i, micro_batches)
            (loss_fn(model, xs, ys) / micro_batches).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_ranks_that_own_nothing_take_part():
    # A 3-element unit and a 2-element param over 8 ranks: most ranks own nothing of the unit, most nothing of
    # the param; every rank still runs the collectives, and the result is the one-process result.
    results = run_on_ranks(_tiny_unit_steps, 8)
    scale_owned = [r[0] for r in results]
    gain_owned = [r[1] for r in results]
    assert sum(scale_owned) == 3 and scale_owned.count(0) >= 5, scale_owned
    assert sum(gain_owned) == 2 and gain_owned.count(0) >= 6, gain_owned
    ref = _tiny_unit_one_process()
    # allowed: the gap of the one-process run batched as the 8 ranks are (the same sum in another order)
    reference = max_diff(_tiny_unit_one_process(micro_batches=8), ref)
    for _, _, params in results:
        assert_within_reference(max_diff(params, ref), reference, magnitude(ref), "8 ranks, tiny units")


def _state_dicts(rank, world_size):
    model = shard(make_model(), fully_shard)
    full = get_full_state_dict(model)
    other = shard(make_model(seed=1), fully_shard)
    load_full_state_dict(other, full)
    return {k: v for k, v in get_full_state_dict(other).items()}


def test_full_state_dict_round_trips_into_plain_torch():
    sd = run_on_ranks(_state_dicts, 3)[0]
    plain = make_model(seed=5)
    plain.load_state_dict(sd)
    ref = make_model()
    assert max_diff(dict(plain.named_parameters()), dict(ref.named_parameters())) == 0


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


def _bad_input(rank, world_size):
    errors = {}
    mixed = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).double())
    for key, fn in {
        "mixed_dtypes": lambda: fully_shard(mixed),
        "twice": lambda: fully_shard(fully_shard(torch.nn.Linear(2, 2))),
        "int_param": lambda: fully_shard(_with_int_param()),
    }.items():
        try:
            fn()
            errors[key] = None
        except (ValueError, TypeError) as e:
            errors[key] = str(e)
    empty = fully_shard(torch.nn.ReLU())
    errors["empty_runs"] = float(empty(torch.ones(2)).sum())
    noncontig = torch.nn.Linear(3, 4)
    noncontig.weight = torch.nn.Parameter(torch.randn(3, 4).t())
    expected = noncontig.weight.detach().clone()
    fully_shard(noncontig)
    errors["noncontig_ok"] = bool(torch.equal(full_tensor(noncontig.weight), expected))
    return errors


def _with_int_param():
    m = torch.nn.Linear(2, 2)
    m.register_parameter("count", torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False))
    return m


def test_bad_input_gets_clear_errors():
    errors = run_on_ranks(_bad_input, 2)[0]
    assert "share a dtype" in errors["mixed_dtypes"] and "'1.weight'" in errors["mixed_dtypes"]
    assert "already called" in errors["twice"]
    assert "count" in errors["int_param"] and "floating-point" in errors["int_param"]
    assert errors["empty_runs"] == 2.0
    assert errors["noncontig_ok"] is True


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


def _clip_like_torch(rank, world_size):
    """ro.clip_grad_norm_ on our params with torch's arguments; torch's on FSDP2's DTensor params (the control, a
    global norm too) on the same model and rows."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from ragged_optim.sharding import full_grad

    x, y = batch(0)
    out = {}
    for norm_type in (1.0, 2.0, 3, float("inf"), "inf"):
        for kind, shard_fn, clip in (("ours", fully_shard, clip_grad_norm_),
                                     ("fsdp2", torch_fully_shard, torch.nn.utils.clip_grad_norm_)):  # fmt: skip
            model = shard(make_model(), shard_fn)
            loss_fn(model, local_rows(x, rank, world_size), local_rows(y, rank, world_size)).backward()
            norm = clip(model.parameters(), 0.1, norm_type=norm_type, error_if_nonfinite=True, foreach=True)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            out[kind, str(norm_type)] = (norm.item(), {n: full_grad(p) for n, p in model.named_parameters()})
    model = shard(make_model(), fully_shard)
    loss_fn(model, local_rows(x, rank, world_size), local_rows(y, rank, world_size)).backward()
    p0 = next(model.parameters())
    if rank == 0 and p0.grad.numel():
        p0.grad.to_local()[0] = float("nan")  # on one rank only: every rank must raise, before any grad changes
    before = {n: full_grad(p) for n, p in model.named_parameters()}
    try:
        clip_grad_norm_(model.parameters(), 0.1, error_if_nonfinite=True)
        raised = None
    except RuntimeError as e:
        raised = str(e)
    unchanged = all(torch.equal(full_grad(p), before[n]) | torch.isnan(before[n]).any()
                    for n, p in model.named_parameters())  # fmt: skip
    return out, raised, unchanged


def test_clip_grad_norm_takes_torchs_arguments():
    """torch's clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach): before, ours took only
    norm_type 2.0 or inf (``"inf"`` was refused as "must be 2.0 or inf, got inf"), and error_if_nonfinite / foreach
    were a TypeError. Each norm equals torch's on FSDP2 within FSDP2's own gap to a one-process norm."""
    results = run_on_ranks(_clip_like_torch, 2)  # (at 3 ranks FSDP2's inf norm fails on an empty local shard)
    out, raised, unchanged = results[0]
    for norm_type in ("1.0", "2.0", "3", "inf", "inf"):
        ours, theirs = out["ours", norm_type], out["fsdp2", norm_type]
        model = make_model()
        x, y = batch(0)
        for r in range(2):
            (loss_fn(model, local_rows(x, r, 2), local_rows(y, r, 2)) / 2).backward()
        flat = torch.cat([p.grad.double().flatten() for p in model.parameters()])
        exact = torch.linalg.vector_norm(flat, float(norm_type)).item()  # float64: the reference both are held to
        assert abs(ours[0] - exact) <= allowed(abs(theirs[0] - exact), exact), norm_type
        coef = min(1.0, 0.1 / (exact + 1e-6))
        clipped = {n: (p.grad.double() * coef).float() for n, p in model.named_parameters()}
        assert max_rel_gap(ours[1], clipped) <= allowed(max_rel_gap(theirs[1], clipped), 1.0), norm_type
    assert all(r[1] and "non-finite" in r[1] for r in results) and all(r[2] for r in results)
