"""RaggedShard runtime on real gloo ranks: sharded training equals the one-process run (AdamW at 1-4 ranks with
either reshard policy, grads against torch FSDP2's, ranks that own nothing of a unit, global grad clipping with
torch's arguments, blocks compiled with torch.compile); full state dicts round-trip into plain torch; bad input
gets a clear error; hyperparameters compare alike in every process."""

import os

import pytest
import torch
from adamw_runs import assert_matches_single, max_diff, sharded_run
from fsdp_models import batch, local_rows, loss_fn, make_model, shard
from noise_bounds import allowed, assert_within_reference, magnitude, max_rel_gap

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


def _compiled(rank, world_size):
    import torch._dynamo

    torch._dynamo.reset()
    out = {}
    for name, compile_blocks in [("eager", False), ("compiled", True)]:
        model = shard(make_model(), fully_shard)
        if compile_blocks:
            for b in model.layers:
                b.compile(backend="aot_eager")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-6)
        recompiles = None
        for step in range(4):
            if step == 2:
                torch._dynamo.utils.counters.clear()
            x, y = batch(step)
            loss_fn(model, local_rows(x, rank, world_size), local_rows(y, rank, world_size)).backward()
            opt.step()
            opt.zero_grad()
        recompiles = dict(torch._dynamo.utils.counters.get("recompiles", {}))
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        out[name] = ([full_tensor(p) for p in model.parameters()], recompiles, frames)
    return out


def test_torch_compile_of_sharded_blocks():
    """Each block compiled (aot_eager) after fully_shard trains like eager: the hooks run outside the graph
    (dynamo is disabled in them, as FSDP2 does) and the steps after the first two compile nothing new."""
    out = run_on_ranks(_compiled, 2)[0]
    eager, _, _ = out["eager"]
    compiled, recompiles, new_graphs = out["compiled"]
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    assert recompiles == {} and new_graphs == 0


def test_settings_compare_alike_in_every_process():
    """The first step compares the ranks' hyperparameters by their text: a set (a user tag) printed in hash order,
    which differs between processes (torchrun's ranks), so identical settings were refused."""
    import subprocess
    import sys

    code = (
        "from ragged_optim.optim.nonfinite import _comparable; "
        "print(_comparable({'tags': {'decay', 'muon', 'hidden', 'layer0', 'abc', 'xyz'}, 'k': frozenset('abcde')}))"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True,
                       text=True, check=True).stdout
        for seed in ("1", "2", "3", "4")
    }  # fmt: skip
    assert len(outs) == 1, outs
