"""Building a sharded model as a big-model job does: meta-device init (``to_empty``, ``init_weights``, with a
transformers ``init_fn``, with a block policy, parents' inits of their children), optimizers built on meta params or
before ``to_empty``, moves and casts after sharding. Each test failed on main for the reason its docstring gives."""

import pytest
import torch
from fsdp_models import Awkward, batch, local_rows, loss_fn, make_model, shard
from torch import nn

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
