"""Runtime features a real job relies on: meta-device init, frozen params, mixed-precision reduction,
torch.compile of sharded blocks. Each test failed on main for the reason its docstring gives."""

import os

import pytest
import torch
from fsdp_models import Awkward, batch, local_rows, loss_fn, make_model, shard
from noise_bounds import allowed
from torch import nn

from ragged_optim.comm.counter import count_collectives
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.memory import peak_bytes
from ragged_optim.sharding import full_grad, full_tensor, fully_shard, init_weights, units_of

# ------------------------------------------------------------------------------------------- meta-device init


def _meta_init(rank, world_size):
    with torch.device("meta"):
        model = Awkward()
    shard(model, fully_shard)

    def materialise():
        model.to_empty(device="cpu")
        torch.manual_seed(0)  # the seed make_model() builds with: init on meta drew no random numbers
        init_weights(model)

    _, peak = peak_bytes(materialise)
    shards = sum(u.local_shard.nbytes for u in units_of(model))
    largest_unit = max(u.layout.total_size * u.local_shard.element_size() for u in units_of(model))
    return [full_tensor(p) for p in model.parameters()], peak, shards, largest_unit


def test_meta_device_init_equals_normal_build_and_holds_shards_plus_one_module():
    """Main: fully_shard refused meta params ("is on the meta device; materialize it first"), so every rank had to
    hold the whole model before sharding. Now: shard on meta, to_empty allocates this rank's shards, init_weights
    runs each module's reset_parameters on its own params full-shaped, one module at a time."""
    params, peak, shards, largest_unit = run_on_ranks(_meta_init, 3)[1]
    ref = [p.detach() for p in make_model().parameters()]
    assert all(torch.equal(a, b) for a, b in zip(params, ref))
    assert peak <= shards + largest_unit  # the bound in docs/runtime.md: this rank's shards plus one unit


def _meta_init_llama(rank, world_size):
    from fsdp_models import tiny_llama

    from ragged_optim.sharding import load_full_state_dict

    plain = tiny_llama()
    with torch.device("meta"):
        model = tiny_llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    for b in model.buffers():
        b.fill_(float("nan"))  # what to_empty leaves is arbitrary memory: make it visible
    init_weights(model, init_fn=model._init_weights)
    buffers = {n: torch.equal(b, dict(plain.named_buffers())[n]) for n, b in model.named_buffers()}
    load_full_state_dict(model, plain.state_dict())
    x = torch.arange(12).view(2, 6) % 96
    with torch.no_grad():
        return buffers, torch.equal(model(input_ids=x).logits, plain(input_ids=x).logits)


def test_meta_init_with_transformers_init_fn_sets_buffers_of_modules_without_params():
    """Before: init_weights skipped modules without params of their own, so a Llama's rotary embedding kept what
    to_empty left in inv_freq (NaN here, arbitrary memory in practice) and the logits were wrong; its buffers are
    not persistent, so loading a checkpoint did not repair them."""
    for buffers, logits_equal in run_on_ranks(_meta_init_llama, 2):
        assert buffers and all(buffers.values()), buffers
        assert logits_equal


def _unmaterialised(rank, world_size):
    with torch.device("meta"):
        model = Awkward()
    shard(model, fully_shard)
    try:
        model(torch.zeros(2, 3, dtype=torch.long))
    except RuntimeError as e:
        return str(e)
    return None


def test_meta_params_left_unmaterialised_are_a_clear_error():
    msg = run_on_ranks(_unmaterialised, 2)[0]
    assert "still on the meta device" in msg and "to_empty" in msg and "init_weights" in msg


def test_init_weights_names_modules_without_reset_parameters():
    class NoInit(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

    with pytest.raises(ValueError, match=r"NoInit\) has params \(w\) but no reset_parameters\(\); pass init_fn="):
        init_weights(nn.Sequential(NoInit()))


# ------------------------------------------------------------------------------------------------ frozen params


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


# ---------------------------------------------------------------------------------- mixed-precision reduction


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


# ------------------------------------------------------------------------------------------------ torch.compile


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


# ------------------------------------------------------------------------------------------ gradient lifetimes


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


def _moves_and_casts(rank, world_size):
    model = shard(make_model(), fully_shard)
    model.to("cpu")
    model.cpu()
    model.float()  # the dtype it has: a no-op
    try:
        model.to("cpu", torch.bfloat16)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    x, y = batch(0)
    loss_fn(model, local_rows(x, rank, world_size), local_rows(y, rank, world_size)).backward()
    return refused, [p.dtype for p in model.parameters()], [full_grad(p) is not None for p in model.parameters()]


def test_moves_to_the_same_device_are_no_ops_and_casts_are_refused_with_nothing_changed():
    """.to("cpu"), .cpu() and .float() on a sharded CPU model change nothing and training goes on; a cast combined
    with a move is refused before any param changed (a probe on an empty meta tensor could not run .to("cpu"))."""
    refused, dtypes, has_grad = run_on_ranks(_moves_and_casts, 2)[0]
    assert refused is not None and "is being cast to torch.bfloat16 after fully_shard" in refused
    assert set(dtypes) == {torch.float32} and all(has_grad)


def _meta_with_block_policy(rank, world_size):
    from ragged_optim import BlockSpec

    with torch.device("meta"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(33, 70), nn.Linear(70, 33))
    fully_shard(model, block_policy=lambda name, p: BlockSpec.matrices(p.shape) if p.ndim == 2 else None)
    model.to_empty(device="cpu")
    init_weights(model)
    return [tuple(full_tensor(p).shape) for p in model.parameters()]


def test_meta_model_with_a_block_policy():
    """A re-plan on meta params (block_policy=, the big-model setup) once read grad flags off the meta device:
    NotImplementedError: Cannot copy out of meta tensor."""
    for shapes in run_on_ranks(_meta_with_block_policy, 2):
        assert shapes == [(70, 33), (70,), (33, 70), (33,)]


def _optimizer_on_meta(rank, world_size):
    from ragged_optim.optim import Muon

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(33, 70), nn.Linear(70, 33))
    fully_shard(model)
    try:
        Muon(model.parameters())
    except RuntimeError as e:
        return str(e)
    return None


def test_an_optimizer_built_on_meta_params_is_a_clear_error():
    """Before: NotImplementedError from an .item() on a meta tensor inside the layout's rank agreement check."""
    for err in run_on_ranks(_optimizer_on_meta, 2):
        assert err is not None and "still on the meta device" in err and "after model.to_empty" in err


def _optimizer_built_on_meta(rank, world_size, before):
    with torch.device("meta"):
        model = Awkward()
    shard(model, fully_shard)
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if before else None
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    init_weights(model)
    if opt is None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    same_objects = all(a is b for a, b in zip(params, model.parameters()))
    x = torch.randint(0, 1001, (4, 5), generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    opt.step()
    return same_objects, [full_tensor(p) for p in model.parameters()]


def test_a_torch_optimizer_built_before_to_empty_trains_the_model():
    """FSDP2 keeps its Parameter objects through ``to_empty``; ours replaced them with new ones when leaving meta, so
    a torch optimizer built before (FSDP2 code in that order) held stale meta params and ``opt.step()`` silently
    changed nothing (0 of 21 tensors of a tiny Llama). Now the objects are kept, and the step equals the one of an
    optimizer built after."""
    before = run_on_ranks(_optimizer_built_on_meta, 2, True)[0]
    after = run_on_ranks(_optimizer_built_on_meta, 2, False)[0]
    assert before[0]
    assert all(torch.equal(a, b) for a, b in zip(before[1], after[1]))


class _ZeroedOut(nn.Module):
    """A block whose reset_parameters reaches into a child (GPT-style: the residual projection starts at 0),
    called at the end of its __init__, as eager construction does; ``gain`` makes it hold a param of its own."""

    def __init__(self, own_param):
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 6)
        self.gain = nn.Parameter(torch.empty(6)) if own_param else None
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.zeros_(self.fc2.weight)
        if self.gain is not None:
            nn.init.normal_(self.gain)


class _ZeroedModel(nn.Module):
    def __init__(self, own_param):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.blocks = nn.ModuleList([_ZeroedOut(own_param) for _ in range(2)])
        self.head = nn.Linear(6, 10)


def _meta_zeroed(rank, world_size, own_param):
    with torch.device("meta"):
        model = _ZeroedModel(own_param)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    init_weights(model)
    return {n: full_tensor(p) for n, p in model.named_parameters()}


@pytest.mark.parametrize("own_param", [True, False])
def test_init_weights_keeps_a_parents_init_of_its_children(own_param):
    """Before: modules ran parent first, on their own params only, so a block's reset_parameters zeroing its child
    fc2 ran before fc2's own init (which overwrote it with random values), or, for a block without params of its
    own, never ran: fc2.weight's largest |value| was 0.25 where the eager build has 0. Now the result equals
    building the model normally with the same seed, bit for bit."""
    torch.manual_seed(0)
    eager = {n: p.detach() for n, p in _ZeroedModel(own_param).named_parameters()}
    got = run_on_ranks(_meta_zeroed, 2, own_param)[0]
    assert got.keys() == eager.keys()
    assert all(torch.equal(got[n], eager[n]) for n in eager), [n for n in eager if not torch.equal(got[n], eager[n])]


def _ema_run(rank, world_size, opt_name, match):
    import torch.nn.functional as F

    import ragged_optim as ro

    def build():
        model = make_model(n_blocks=2)
        if world_size > 1:
            shard(model, fully_shard)
        return model

    student, ema = build(), build()
    for p in ema.parameters():
        p.requires_grad_(False)
    if opt_name == "adamw8bit":
        opt = ro.AdamW8bit(student.parameters(), lr=3e-3, block_size=256, min_8bit_size=256)
    else:
        opt = ro.Shampoo(student.parameters(), lr=3e-3, max_preconditioner_dim=16)
    if match and world_size > 1:
        ro.match_layout(ema, student)
    x, y = batch(0, n=6)
    try:
        for _ in range(2):
            rows = (local_rows(x, rank, world_size), local_rows(y, rank, world_size)) if world_size > 1 else (x, y)
            F.cross_entropy(student(rows[0]).flatten(0, 1), rows[1].flatten()).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                torch._foreach_lerp_(list(ema.parameters()), list(student.parameters()), 0.5)
    except RuntimeError as e:
        return str(e)
    full = lambda m: {n: full_tensor(p) for n, p in m.named_parameters()}  # noqa: E731
    return full(ema), full(student)


@pytest.mark.parametrize("opt_name", ["adamw8bit", "shampoo"])
def test_match_layout_pairs_an_ema_model_with_its_student(opt_name):
    """An EMA twin sharded like its student: the student's optimizer re-plans the student's units for its blocks,
    so ``torch._foreach_lerp_(ema params, student params)`` met pieces of other lengths ("The size of tensor a
    (1368) must match the size of tensor b (1536)") or, where lengths happened to agree, other elements.
    ``ro.match_layout(ema, student)`` gives the EMA the student's layout; the EMA then equals the one-process
    EMA within the student's own gap to one process (the same elements, lerped)."""
    from noise_bounds import magnitude, max_abs_gap

    ema_one, student_one = run_on_ranks(_ema_run, 1, opt_name, False)[0]
    got = run_on_ranks(_ema_run, 3, opt_name, True)[0]
    assert isinstance(got, tuple), got
    ema, student = got
    assert max_abs_gap(ema, ema_one) <= allowed(max_abs_gap(student, student_one), magnitude(ema_one))
    unmatched = run_on_ranks(_ema_run, 3, opt_name, False)[0]
    assert isinstance(unmatched, str) and "different layouts" in unmatched and "match_layout" in unmatched


def _twin_on_another_mesh(rank, world_size):
    from torch.distributed.device_mesh import DeviceMesh

    import ragged_optim as ro

    a = DeviceMesh("cpu", torch.tensor([[0, 1], [2, 3]]), mesh_dim_names=("replicate", "shard"))
    b = DeviceMesh("cpu", torch.tensor([[0, 2], [1, 3]]), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    m, ema = nn.Sequential(nn.Linear(16, 32, bias=False)), nn.Sequential(nn.Linear(16, 32, bias=False))
    fully_shard(m, mesh=a)
    fully_shard(ema, mesh=b)
    try:
        ro.match_layout(ema, m)
    except ValueError as e:
        return str(e)
    return None


def test_match_layout_refuses_a_twin_on_another_mesh():
    """Twins whose shard groups hold other ranks (the transposed 2x2 mesh) were matched by world size alone: the
    pieces then held other elements, and an EMA update mixed them (0.47 off where it must be exact)."""
    for err in run_on_ranks(_twin_on_another_mesh, 4, timeout_s=90):
        assert err is not None and "on the same mesh (shard group ranks" in err


def _weakly_held_param(rank, world_size):
    import warnings

    from torch.utils.weak import WeakIdKeyDictionary

    with torch.device("meta"):
        model = nn.Linear(4, 4)
    fully_shard(model)
    registry = WeakIdKeyDictionary({p: True for p in model.parameters()})  # (a param registry, as tools keep)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.to_empty(device="cpu")
    del registry
    return [str(w.message) for w in caught if "weak reference" in str(w.message)]


def test_to_empty_says_when_it_cannot_keep_a_param_object():
    """swap_tensors refuses a param held by a weak reference; to_empty then makes a new Parameter, and an optimizer
    built before it silently updated the old one. It now warns, naming the param."""
    msgs = run_on_ranks(_weakly_held_param, 2, timeout_s=60)[0]
    assert msgs and "an optimizer built before to_empty does not hold the new one" in msgs[0]


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
