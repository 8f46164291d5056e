"""Muon on ragged-sharded and FSDP2 DTensor params equals one-process Muon (hypothesis over shapes, world sizes)."""

import torch
from fsdp_models import Mats
from fsdp_models import grads_for as mats_grads
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from noise_bounds import assert_within_reference
from torch import nn

from ragged_optim.comm.counter import count_collectives
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.optim import Muon
from ragged_optim.optim.nonfinite import set_nonfinite_policy
from ragged_optim.sharding import full_tensor, fully_shard
from ragged_optim.testing import set_full_grad

STEPS = 3


def grads_for(shapes, step, seed):
    *mats, bias = mats_grads(shapes, step, seed)
    return mats, bias


def one_process(shapes, seed, ns_dtype):
    model = Mats(shapes, seed)
    opt = Muon(model.parameters(), lr=0.05, weight_decay=0.1, ns_dtype=ns_dtype, adamw_lr=0.01)
    for step in range(STEPS):
        gs, gb = grads_for(shapes, step, seed)
        for p, g in zip(model.ws, gs):
            p.grad = g
        model.bias.grad = gb
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def reference(shapes, seed, ns_dtype):
    """The one-process run with one thread, as each rank runs, and the gap allowed around it. Every rank gets the
    same full grads and an owner computes each matrix whole with the same ops, so the only source of difference is
    how a matmul splits its sums, which may depend on the thread count: the allowed gap is the one-process run's
    own gap between one thread and this process's thread count, measured here (0.0 with one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = one_process(shapes, seed, ns_dtype)
    finally:
        torch.set_num_threads(threads)
    return ref, max_rel(one_process(shapes, seed, ns_dtype), ref)


def _set_local_grads(model, shapes, step, seed, rank, world_size, kind):
    from ragged_optim.sharding import shard_info

    gs, gb = grads_for(shapes, step, seed)
    for p, g in zip(list(model.ws) + [model.bias], gs + [gb]):
        if kind == "ragged":
            lo, hi = shard_info(p).local_range
            set_full_grad(p, g)
        else:
            from torch.distributed.tensor import distribute_tensor

            p.grad = distribute_tensor(g, p.device_mesh, p.placements)


def sharded(rank, world_size, shapes, seed, ns_dtype, kind):
    model = Mats(shapes, seed)
    if kind == "ragged":
        fully_shard(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        torch_fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    opt = Muon(model.parameters(), lr=0.05, weight_decay=0.1, ns_dtype=ns_dtype, adamw_lr=0.01)
    calls = []
    for step in range(STEPS):
        _set_local_grads(model, shapes, step, seed, rank, world_size, kind)
        with count_collectives() as stats:
            opt.step()
        calls.append(stats.calls.get("all_to_all", 0))
    return [full_tensor(p).clone() for p in model.parameters()], calls


shape_st = st.one_of(
    st.tuples(st.integers(1, 40), st.integers(1, 40)),  # tall, wide, 1 x N, N x 1, rows < world size
    st.tuples(st.integers(1, 3), st.integers(1, 12), st.integers(1, 12)),  # stacks [E, R, C]
)


def max_rel(a, b):
    return max(((x - y).abs().max() / y.abs().max().clamp(min=1e-30)).item() for x, y in zip(a, b))


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(shapes=st.lists(shape_st, min_size=1, max_size=4), world_size=st.integers(1, 6), seed=st.integers(0, 99))
def test_ragged_muon_fp32_equals_one_process(shapes, world_size, seed):
    ref, gap = reference(shapes, seed, torch.float32)
    params, calls = run_on_ranks(sharded, world_size, shapes, seed, torch.float32, "ragged")[0]
    assert_within_reference(max_rel(params, ref), gap, 1.0, f"fp32 Muon, {world_size} ranks")
    assert all(c <= 2 for c in calls)  # one gather and one scatter per group per step, at most


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(shapes=st.lists(shape_st, min_size=1, max_size=3), world_size=st.integers(2, 5), seed=st.integers(0, 99))
def test_ragged_muon_bf16_equals_one_process_bf16(shapes, world_size, seed):
    # NS casts to bf16 first, so bf16 on the wire and one owner per matrix reproduce the one-process bf16 run: a
    # single flipped bf16 rounding would show as ~4e-3 (one bf16 ulp), far above the bound (unless the thread
    # count alone flips one in the reference too: then the bound says so).
    ref, gap = reference(shapes, seed, torch.bfloat16)
    params, _ = run_on_ranks(sharded, world_size, shapes, seed, torch.bfloat16, "ragged")[0]
    assert_within_reference(max_rel(params, ref), gap, 1.0, f"bf16 Muon, {world_size} ranks")


def _batched_sharded(rank, world_size, shapes, seed):
    sizes = []
    real = torch.baddbmm

    def spy(input, batch1, batch2, *args, **kwargs):
        sizes.append(batch1.shape[0])
        return real(input, batch1, batch2, *args, **kwargs)

    torch.baddbmm = spy
    try:
        params, _ = sharded(rank, world_size, shapes, seed, torch.bfloat16, "ragged")
    finally:
        torch.baddbmm = real
    return params, sizes


def test_ragged_muon_small_matrix_batches_equal_one_process_bitwise():
    """The default batches same-shape small matrices on a CPU (each rank those it holds whole, the one process all
    of them: other sets) only where the batched Newton-Schulz is probed bitwise the per-matrix one, so the sharded
    run is the one-process run bit for bit, at two world sizes."""
    from ragged_optim.kernels.newton_schulz import (
        DEFAULT_NS_COEFFICIENTS,
        DEFAULT_NS_EPS,
        DEFAULT_NS_STEPS,
        batched_is_exact,
        batching_pays,
    )

    shapes = [(64, 64)] * 5 + [(48, 64)] * 3 + [(40, 33)]
    ref, _ = reference(shapes, 3, torch.bfloat16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs
    try:
        kw = dict(steps=DEFAULT_NS_STEPS, coefficients=DEFAULT_NS_COEFFICIENTS, eps=DEFAULT_NS_EPS)
        batches_here = batching_pays(64, 64, torch.bfloat16, "cpu", "auto") and batched_is_exact(
            2, 64, 64, torch.bfloat16, "cpu", **kw, dtype=torch.bfloat16, matmul="auto"
        )
    finally:
        torch.set_num_threads(threads)
    for world_size in (2, 3):
        results = run_on_ranks(_batched_sharded, world_size, shapes, 3)
        sizes = [sorted(set(s)) for _, s in results]
        print(f"\n[muon sharded small batches] world {world_size}: batch sizes per rank {sizes}")
        for p, r in zip(results[0][0], ref):
            assert torch.equal(p, r), (world_size, tuple(r.shape))
        assert any(sizes) or not batches_here, sizes  # (here the ranks did batch: the test is not vacuous)


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(shapes=st.lists(shape_st, min_size=1, max_size=3), world_size=st.integers(1, 4), seed=st.integers(0, 99))
def test_dtensor_muon_equals_one_process(shapes, world_size, seed):
    ref, gap = reference(shapes, seed, torch.float32)
    params, calls = run_on_ranks(sharded, world_size, shapes, seed, torch.float32, "dtensor")[0]
    assert_within_reference(max_rel(params, ref), gap, 1.0, f"fp32 Muon on DTensors, {world_size} ranks")
    assert all(c <= 2 for c in calls)


def _two_whole_matrices(rank, world_size):
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    fully_shard(model)
    opt = Muon(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # the first step also checks that the ranks agree on the param set (one all_gather)
    set_nonfinite_policy(opt, "off")  # the per-step NaN/Inf agreement is one 1-element all_reduce
    with count_collectives() as stats:
        opt.step()
    local_sizes = [p.to_local().numel() for p in model.parameters()]
    return stats.total_calls, local_sizes, [opt.has_cut_blocks(p) for p in opt_params(opt)]


def opt_params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def test_matrices_whole_on_their_ranks_move_nothing():
    # Two 8x8 matrices over 2 ranks: each rank holds one whole and owns it, so the step communicates nothing.
    for calls, local_sizes, cut in run_on_ranks(_two_whole_matrices, 2):
        assert sorted(local_sizes) == [0, 64] and calls == 0 and cut == [False, False]


def _fsdp2_row_chunks(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    torch_fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    opt = Muon(model.parameters())
    return [opt.has_cut_blocks(p) for p in opt_params(opt)]


def test_has_cut_blocks_same_answer_on_every_rank():
    # FSDP2 gives each of 2 ranks 4 rows of every 8x8 matrix: every matrix is cut, and every rank says so (Muon then
    # exchanges them together); the whole-matrix case above says False on both ranks.
    assert run_on_ranks(_fsdp2_row_chunks, 2) == [[True, True], [True, True]]


def _wire_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 24, bias=False), nn.Linear(24, 40, bias=False))


def _wire_grads(shapes):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*s, generator=g) for s in shapes]


def _wire(rank, world_size, wire):
    from ragged_optim.sharding import shard_info

    model = _wire_model()
    fully_shard(model)
    opt = Muon(model.parameters(), ns_dtype=torch.float32, wire_dtype=wire)
    start = [full_tensor(p) for p in model.parameters()]
    for p, g in zip(model.parameters(), _wire_grads([shard_info(p).shape for p in model.parameters()])):
        lo, hi = shard_info(p).local_range
        set_full_grad(p, g)
    set_nonfinite_policy(opt, "off")
    with count_collectives() as stats:
        opt.step()
    return start, [full_tensor(p) for p in model.parameters()], stats.bytes.get("all_to_all", 0)


def _int8_per_matrix(t):
    """Symmetric int8 with one scale per matrix (absmax / 127): at least as coarse as the wire's blocks."""
    scale = t.abs().max() / 127
    return t if scale == 0 else (t / scale).round().clamp(-127, 127) * scale


def _one_process_wire(rnd, monkeypatch):
    """One step of one-process Muon (fp32 Newton-Schulz) with every matrix's momentum rounded by ``rnd`` before
    Newton-Schulz and its orthogonalized update after: the wire's rounding as if all of every matrix travelled
    (ours sends only the pieces held off their owner)."""
    import ragged_optim.optim.muon as muon_module

    real = muon_module.newton_schulz
    if rnd is not None:
        monkeypatch.setattr(muon_module, "newton_schulz", lambda x, **kw: rnd(real(rnd(x), **kw)))
    model = _wire_model()
    opt = Muon(model.parameters(), ns_dtype=torch.float32)
    for p, g in zip(model.parameters(), _wire_grads([p.shape for p in model.parameters()])):
        p.grad = g
    opt.step()
    monkeypatch.setattr(muon_module, "newton_schulz", real)
    return [p.detach().clone() for p in model.parameters()]


def test_muon_wire_dtypes_cut_bytes_within_their_error(monkeypatch):
    """bf16 / int8 on the wire cut the bytes; the params move off the fp32-wire run by that rounding's effect,
    bounded by FACTOR x the effect of the same rounding on every whole matrix in one process, measured here."""
    _, exact, fp32_bytes = run_on_ranks(_wire, 3, None)[0]
    _, bf16, bf16_bytes = run_on_ranks(_wire, 3, torch.bfloat16)[0]
    _, int8, int8_bytes = run_on_ranks(_wire, 3, "int8")[0]
    assert bf16_bytes * 2 == fp32_bytes and int8_bytes < 0.27 * fp32_bytes
    one = _one_process_wire(None, monkeypatch)
    scale = max(e.abs().max().item() for e in exact)
    for approx, rnd, what in ((bf16, lambda t: t.bfloat16().to(t.dtype), "bf16"), (int8, _int8_per_matrix, "int8")):
        err = max((a - e).abs().max().item() for a, e in zip(approx, exact))
        sim = _one_process_wire(rnd, monkeypatch)
        ref = max((a - e).abs().max().item() for a, e in zip(sim, one))
        assert err > 0, what  # the wire really rounds
        assert_within_reference(err, ref, scale, f"{what} wire vs fp32 wire")


def _whole_matrix_step_bytes(rank, world_size, n):
    from ragged_optim.kernels.newton_schulz import newton_schulz
    from ragged_optim.memory import peak_bytes

    model = nn.Sequential(nn.Linear(n, n, bias=False), nn.Linear(n, n, bias=False))
    fully_shard(model)
    opt = Muon(model.parameters(), ns_dtype=torch.float32, ns_matmul="native")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # state exists from here on
    _, step_peak = peak_bytes(opt.step)
    mine = next(p for p in model.parameters() if p.numel())
    x = torch.randn(n, n)
    _, ns_peak = peak_bytes(lambda: newton_schulz(x, dtype=torch.float32, matmul="native"))
    return step_peak, ns_peak, mine.numel() * 4


def test_matrix_whole_on_its_owner_is_not_copied():
    """Two n x n matrices over 2 ranks, each whole on the rank that owns it: the step's peak is the update plus one
    Newton-Schulz run's own temporaries (measured in the same process), with no gather copy of the matrix, no kept
    result and no separate output. Measured at n = 256: the step peaks at 5 matrices (1 update + 4 of Newton-Schulz);
    before the block API computed owner-held matrices in place it peaked at 7 (a gather copy, a kept result)."""
    for step_peak, ns_peak, matrix in run_on_ranks(_whole_matrix_step_bytes, 2, 256):
        assert step_peak <= matrix + ns_peak + matrix // 4, (step_peak, ns_peak, matrix)


def _bounded_exchanges(rank, world_size):
    """Eight 48x40 matrices in one unit over 3 ranks (most of them cut), one step with each exchange bound: the params,
    the all_to_all count and the step's exact peak (above the level before it)."""
    from ragged_optim import alloc_counter
    from ragged_optim.memory import peak_bytes

    alloc_counter.install()
    out = {}
    for limit in (None, 1):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(40, 48, bias=False) if i % 2 == 0 else nn.Linear(48, 40, bias=False)
                                for i in range(8)])  # fmt: skip
        fully_shard(model)
        opt = Muon(model.parameters(), ns_dtype=torch.float32)
        opt.exchange_max_bytes = limit
        set_nonfinite_policy(opt, "off")
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            set_full_grad(p, torch.randn(*p.shape, generator=g))
        cut = [opt.has_cut_blocks(p) for p in model.parameters()]
        opt.step()  # (first step: momentum buffers, routes)
        with count_collectives() as stats:
            _, peak = peak_bytes(opt.step)
        out[limit] = ([full_tensor(p) for p in model.parameters()], stats.calls.get("all_to_all", 0), peak, cut)
    return out


def test_bounded_exchanges_change_no_bit_and_hold_less():
    # exchange_max_bytes=1: each cut matrix goes through its own exchange (two all_to_alls), one update alive at a
    # time instead of all of them with their gathered blocks; Newton-Schulz sees the same matrices, so the same bits.
    runs = run_on_ranks(_bounded_exchanges, 3)
    for got in runs:
        (p_all, calls_all, _, cut), (p_one, calls_one, _, _) = got[None], got[1]
        assert sum(cut) >= 2 and calls_all == 2 and calls_one == 2 * sum(cut), (cut, calls_all, calls_one)
        assert all(torch.equal(a, b) for a, b in zip(p_all, p_one))
    peaks = {limit: max(got[limit][2] for got in runs) for limit in (None, 1)}  # (the highest rank's, as bench memory)
    assert peaks[1] < peaks[None], peaks
