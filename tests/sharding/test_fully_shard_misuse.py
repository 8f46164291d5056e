"""Misuse of fully_shard and clip_grad_norm_ gets a clear error, or is honoured correctly, never silently ignored:
requires_grad changed after sharding, reshard_after_forward values, the root sharded before its submodules, lists
and containers without forward, casting after sharding, wrong argument types, a negative max_norm.

Checks that need a process group share one run of 2 gloo ranks (a module-scoped fixture); the rest run here."""

import pytest
import torch
import torch.distributed as dist
from fsdp_models import TwoLinear as Net
from fsdp_models import _err, shard_two_linear
from noise_bounds import assert_within_reference, magnitude
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.sharding import clip_grad_norm_, full_tensor, fully_shard, units_of

WORLD = 2
LR = 0.1


def sharded_net(**kw):
    return shard_two_linear(fully_shard, **kw)


def _x():
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(1))


def _train(model, rows, steps, before_step=None, micro_batches=1):
    """SGD on ``rows`` of the batch (split into ``micro_batches`` accumulated micro-batches); ``before_step(step)``
    may freeze/unfreeze. Returns, per step, the names of the params whose .grad is None after backward."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    no_grad = []
    for step in range(steps):
        if before_step is not None:
            before_step(model, step)
        for x in _x()[rows].chunk(micro_batches):
            (model(x).pow(2).mean() / micro_batches).backward()
        no_grad.append(sorted(n for n, p in model.named_parameters() if p.grad is None))
        opt.step()
        opt.zero_grad()
    return no_grad


def _freeze_a_weight_at_step_1(model, step):
    if step == 1:
        model.a.weight.requires_grad_(False)


def _unfreeze_b_weight(model, step):
    model.b.weight.requires_grad_(True)


def _frozen_b_weight():
    m = Net()
    m.b.weight.requires_grad_(False)
    return m


def _reference(make, before_step, micro_batches=1):
    """One process, the whole batch: the mean over 8 rows equals the mean of the 2 ranks' means over 4 rows.
    ``micro_batches=WORLD``: the same sum in the ranks' grouping, for the tolerance (tests/support/noise_bounds.py)."""
    model = make()
    no_grad = _train(model, slice(None), 3, before_step, micro_batches)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, no_grad


def _assert_matches_reference(params, make, before_step, ref_params, what):
    """Within the gap between two batchings of the one-process run, measured here: fp32 sums in another order."""
    other, _ = _reference(make, before_step, micro_batches=WORLD)
    assert_within_reference(_max_diff(params, ref_params), _max_diff(other, ref_params), magnitude(ref_params), what)


def _full_params(model):
    return {n: full_tensor(p).clone() for n, p in model.named_parameters()}


def _on_ranks(rank, world_size):
    out = {}
    rows = slice(rank * 4, (rank + 1) * 4)

    # 1. requires_grad changed after fully_shard: trained then frozen, and frozen then unfrozen.
    m = sharded_net()
    out["freeze_no_grad"] = _train(m, rows, 3, _freeze_a_weight_at_step_1)
    out["freeze_params"] = _full_params(m)
    m = _frozen_b_weight()
    for mod in (m.a, m.b, m):
        fully_shard(mod)
    out["unfreeze_no_grad"] = _train(m, rows, 3, _unfreeze_b_weight)
    out["unfreeze_params"] = _full_params(m)

    # 2. reshard_after_forward=None: inner units reshard after forward, the root keeps its params for backward.
    m = Net()
    fully_shard(m.a, reshard_after_forward=None)
    fully_shard(m, reshard_after_forward=None)  # the root owns b's params
    loss = m(_x()[rows]).pow(2).mean()
    out["none_unsharded_after_forward"] = [u.is_unsharded for u in units_of(m)]  # a, root
    loss.backward()
    out["set_reshard_int"] = _err(lambda: m.set_reshard_after_forward(2))

    # 3. The root sharded before its submodules.
    m = Net()
    fully_shard(m)
    out["root_first"] = _err(lambda: fully_shard(m.a))

    # 4. A container without forward is fine once every param in it belongs to an inner unit (an empty unit).
    def shard_layers():
        layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
        for layer in layers:
            fully_shard(layer)
        fully_shard(layers)

    out["empty_container"] = _err(shard_layers)

    # 5. Cast after fully_shard: a clear error at the cast itself, before any param changed (the model trains on).
    for key, cast in {"bf16": lambda m: m.to(torch.bfloat16), "double": lambda m: m.double()}.items():
        m = sharded_net()
        out[f"cast_{key}"] = _err(lambda m=m, cast=cast: cast(m))
        out[f"cast_{key}_untouched"] = m.a.weight.dtype == torch.float32 and _train(m, rows, 1) == [[]]
    m = sharded_net()
    m.b.bias.data = torch.zeros_like(m.b.bias)  # same dtype, but no longer a view of the flat buffer
    out["data_replaced"] = _err(lambda: m(_x()[rows]))
    m = sharded_net()
    m.a.weight = nn.Parameter(torch.zeros(8, 8))  # a new Parameter object: the next unshard would drop it
    out["param_replaced"] = _err(lambda: m(_x()[rows]))
    # The errors left no half-done iteration behind: a fresh model still trains.
    out["after_cast_trains"] = _train(sharded_net(), rows, 1) == [[]]

    # 6. A process group that leaves this rank out (new_group gives non-members a placeholder, not a group).
    group = dist.new_group([0])
    out["not_a_member"] = _err(lambda: fully_shard(Net(), mesh=group))
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(_on_ranks, WORLD)


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ----------------------------------------------------------------------------------------------- 1. requires_grad


def test_param_frozen_after_fully_shard_gets_no_grad_and_stays_put(ranks):
    ref_params, ref_no_grad = _reference(Net, _freeze_a_weight_at_step_1)
    assert ref_no_grad == [[], ["a.weight"], ["a.weight"]]
    initial = Net().a.weight.detach()
    for r in ranks:
        assert r["freeze_no_grad"] == ref_no_grad  # None, not zeros, so optimizers skip it
        _assert_matches_reference(r["freeze_params"], Net, _freeze_a_weight_at_step_1, ref_params, "frozen at step 1")
    # it trained at step 0 only: the frozen steps did not move it
    assert not torch.equal(ranks[0]["freeze_params"]["a.weight"], initial)


def test_param_unfrozen_after_fully_shard_trains(ranks):
    ref_params, ref_no_grad = _reference(_frozen_b_weight, _unfreeze_b_weight)
    assert ref_no_grad == [[], [], []]
    for r in ranks:
        assert r["unfreeze_no_grad"] == ref_no_grad
        _assert_matches_reference(r["unfreeze_params"], _frozen_b_weight, _unfreeze_b_weight, ref_params, "unfrozen")
    assert not torch.equal(ranks[0]["unfreeze_params"]["b.weight"], Net().b.weight.detach())


# ------------------------------------------------------------------------------------- 2. reshard_after_forward


def test_reshard_after_forward_none_is_torchs_default(ranks):
    for r in ranks:
        assert r["none_unsharded_after_forward"] == [False, True]  # the inner unit resharded, the root kept
        assert "takes True or False" in r["set_reshard_int"]


@pytest.mark.parametrize("value", [2, 0, "yes", 1.0])
def test_reshard_after_forward_rejects_non_bools(value):
    with pytest.raises(ValueError, match=r"reshard_after_forward.*takes True .*False .*None"):
        fully_shard(nn.Linear(2, 2), reshard_after_forward=value)


def test_reshard_after_forward_int_names_what_is_unsupported():
    with pytest.raises(ValueError, match="an int .*smaller group.* is not supported"):
        fully_shard(nn.Linear(2, 2), reshard_after_forward=2)


# ----------------------------------------------------------------------------------------------- 3. order


def test_root_sharded_before_submodule_is_refused(ranks):
    for r in ranks:
        e = r["root_first"]
        assert e.startswith("ValueError") and "'weight'" in e and "enclosing TwoLinear" in e
        assert "inner modules first and on the root last" in e


# ----------------------------------------------------------------------------------------------- 4. lists, containers


def test_not_a_module_is_refused():
    # (lists of modules are one unit, as in FSDP2: tests/sharding/test_fsdp_module_dropin.py)
    with pytest.raises(TypeError, match="takes an nn.Module, got a Tensor"):
        fully_shard(torch.zeros(2))


@pytest.mark.parametrize("container", [nn.ModuleList([nn.Linear(2, 2)]), nn.ModuleDict({"0": nn.Linear(2, 2)})])
def test_container_without_forward_is_refused(container):
    name = type(container).__name__
    with pytest.raises(TypeError, match=f"a {name} has no forward.*'0.weight'.*fully_shard on each module inside it"):
        fully_shard(container)
    assert not hasattr(container, "_ragged_state")  # nothing was half-done


def test_container_whose_params_are_all_in_inner_units_is_accepted(ranks):
    for r in ranks:
        assert r["empty_container"] is None


# ----------------------------------------------------------------------------------------------- 5. casting


def test_cast_after_fully_shard_is_refused_with_nothing_changed(ranks):
    for r in ranks:
        for key, dtype in {"bf16": "torch.bfloat16", "double": "torch.float64"}.items():
            e = r[f"cast_{key}"]
            assert e.startswith("RuntimeError") and "'weight' (in Linear)" in e and dtype in e
            assert "before fully_shard" in e and "mp_policy=MixedPrecisionPolicy" in e
            assert r[f"cast_{key}_untouched"] is True
        e = r["data_replaced"]
        assert e.startswith("RuntimeError") and "'bias' (in Linear) no longer lives in fully_shard's flat buffer" in e
        e = r["param_replaced"]
        assert e.startswith("RuntimeError") and "'weight' (in Linear) was replaced after fully_shard" in e
        assert r["after_cast_trains"] is True


# ----------------------------------------------------------------------------------------------- 6. argument types


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"mp_policy": torch.bfloat16}, r"mp_policy=torch.bfloat16\): mp_policy takes a .*MixedPrecisionPolicy"),
        ({"comm_policy": "int8"}, r"comm_policy='int8'\): comm_policy takes a CommPolicy.*QuantizedAllGather"),
        ({"mesh": "cpu"}, r"mesh='cpu'\): mesh takes a DeviceMesh .* ProcessGroup, or None.*init_device_mesh"),
        ({"mesh": 2}, r"mesh=2\): mesh takes a DeviceMesh"),
        ({"block_policy": "muon"}, r"block_policy='muon'\): block_policy takes fn\(name, param\)"),
    ],
)
def test_wrong_argument_types_name_the_argument(kw, match):
    with pytest.raises(TypeError, match=match):
        fully_shard(nn.Linear(2, 2), **kw)


def test_mp_policy_dtypes_are_checked():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    with pytest.raises(TypeError, match="mp_policy.param_dtype must be a floating-point torch.dtype"):
        fully_shard(nn.Linear(2, 2), mp_policy=MixedPrecisionPolicy(param_dtype=torch.int8))


def test_group_without_this_rank_is_refused(ranks):
    assert ranks[0]["not_a_member"] is None  # rank 0 is in the group of one
    e = ranks[1]["not_a_member"]
    assert e.startswith("ValueError") and "this rank is not a member of the given process group" in e
    with pytest.raises(ValueError, match="not a member"):  # the placeholder itself, without a process group
        fully_shard(nn.Linear(2, 2), mesh=dist.GroupMember.NON_GROUP_MEMBER)


# ----------------------------------------------------------------------------------------------- 7. clip


@pytest.mark.parametrize("max_norm", [-1.0, float("nan"), torch.tensor(-0.5), "1", None])
def test_clip_grad_norm_rejects_negative_max_norm(max_norm):
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    with pytest.raises(ValueError, match="max_norm must be a number >= 0"):
        clip_grad_norm_([p], max_norm)
    assert torch.equal(p.grad, torch.full((3,), 2.0))  # untouched
    clip_grad_norm_([p], torch.tensor(0.0))  # 0 and tensors are fine
    assert torch.equal(p.grad, torch.zeros(3))


def _mixed_precision_casts(rank, world_size):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    out = {}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    for key, policy in {
        "inputs_cast": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        "output_fp32": MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32),
        "no_input_cast": MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False),
    }.items():
        model = sharded_net(mp_policy=policy)
        try:
            y = model(x)
            y.float().sum().backward()
            out[key] = (y.dtype, all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters()))
        except RuntimeError as e:
            out[key] = str(e).splitlines()[0]
    return out


def test_mixed_precision_casts_forward_inputs_and_outputs_like_fsdp2():
    # fp32 inputs into a bf16-compute model: cast as FSDP2 does (cast_forward_inputs=True by default), outputs cast
    # to output_dtype when set; with cast_forward_inputs=False the fp32 input meets bf16 weights, as in FSDP2.
    res = run_on_ranks(_mixed_precision_casts, WORLD)[0]
    assert res["inputs_cast"] == (torch.bfloat16, True)
    assert res["output_fp32"] == (torch.float32, True)
    assert isinstance(res["no_input_cast"], str) and "dtype" in res["no_input_cast"]


def _other_model_per_rank(rank, world_size):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 12 + rank), nn.ReLU(), nn.Linear(12 + rank, 4))
    try:
        fully_shard(m)
        m(torch.randn(4, 8))
    except ValueError as e:
        return str(e), isinstance(m, FSDPModule)
    return None, isinstance(m, FSDPModule)


def test_ranks_that_sharded_different_models_raise_at_fully_shard():
    """A model built differently on one rank (a config read per rank): the first forward's all-gathers did not pair
    up and gloo aborted the process (``op.preamble.length <= op.nbytes. 120 vs 112 ... Is there a distributed
    collective mismatch``). Then every rank raised at the first forward; now every rank raises the same ValueError
    at the fully_shard call, naming the first param that differs, with the module left unsharded."""
    for err, sharded in run_on_ranks(_other_model_per_rank, 2, timeout_s=60):
        assert err is not None and "fully_shard(Sequential): ranks sharded different models" in err
        assert not sharded
        assert "[12, 8]" in err and "[13, 8]" in err and "on rank 1" in err


def _clip_other_params_per_rank(rank, world_size):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    fully_shard(m)
    m(torch.randn(4, 16)).sum().backward()
    ps = list(m.parameters())
    try:
        clip_grad_norm_(ps if rank == 0 else ps[:2], 1.0)
    except ValueError as e:
        return str(e)
    return None


def test_clip_grad_norm_of_other_params_per_rank_is_refused_on_every_rank():
    """Rank 0 passing 4 params and rank 1 two (a list filtered per rank): the "global" norm summed rank 0's pieces
    of 4 params with rank 1's of 2, silently, and each rank clipped by it. The params' count and size now travel
    in the norm's own all-reduce (no extra collective) and every rank raises."""
    for err in run_on_ranks(_clip_other_params_per_rank, 2, timeout_s=60):
        assert err is not None and "the ranks passed different params" in err


def _flags_and_twins(rank, world_size):
    import ragged_optim as ro

    m = Net()
    fully_shard(m)
    out = {}
    for name, call in (("sync", lambda: m.set_requires_gradient_sync("False")),
                       ("cpu", lambda: ro.get_full_state_dict(m, cpu="no"))):  # fmt: skip
        try:
            call()
        except ValueError as e:
            out[name] = str(e)
    other = nn.Sequential(nn.Linear(8, 9), nn.Linear(9, 4))
    fully_shard(other)
    try:
        ro.match_layout(other, m)
    except ValueError as e:
        out["twin"] = str(e)
    return out


def test_flags_take_bools_and_match_layout_names_the_shapes():
    """Before: set_requires_gradient_sync("False") and get_full_state_dict(cpu="no") took the strings for True
    (FSDP2 does not check either); match_layout's refusal described both units alike, leaving out the shapes that
    differ."""
    out = run_on_ranks(_flags_and_twins, 2, timeout_s=60)[0]
    assert "takes True or False" in out["sync"] and "takes True or False" in out["cpu"]
    assert "(9, 8)" in out["twin"] and "(8, 8)" in out["twin"]


def _full_state_dict_misuse(rank, world_size):
    from ragged_optim.sharding import load_full_state_dict

    m = Net()
    fully_shard(m)
    out = {}
    for name, sd in (("none", None), ("missing", {}), ("list", {k: [0.0] for k in Net().state_dict()})):
        try:
            load_full_state_dict(m, sd)
        except (TypeError, RuntimeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def test_load_full_state_dict_misuse_is_named():
    """Before: ``argument of type 'NoneType' is not iterable``, a KeyError (its message printed with escaped quotes;
    torch's load_state_dict raises RuntimeError) and ``'list' object has no attribute 'shape'``."""
    out = run_on_ranks(_full_state_dict_misuse, 2, timeout_s=60)[0]
    assert out["none"].startswith("TypeError: load_full_state_dict: state_dict must be a mapping")
    assert out["missing"].startswith("RuntimeError: load_full_state_dict: keys do not match the model")
    assert out["list"].startswith("TypeError: load_full_state_dict: 'a.weight' is a list, not a tensor")


def test_helpers_name_arguments_of_the_wrong_kind():
    """Before: raw AttributeErrors from inside (``'NoneType' object has no attribute ...``, ``'list' object has no
    attribute 'named_modules'``, ``'int' object is not callable``), none naming the argument."""
    import ragged_optim as ro

    lin = nn.Linear(2, 2)
    cases = [
        (lambda: ro.full_tensor(None), "full_tensor: takes one param"),
        (lambda: ro.full_grad("x"), "full_grad: takes one param"),
        (lambda: ro.full_shape([1]), "full_shape: takes one param"),
        (lambda: ro.init_weights("x"), "init_weights: model must be an nn.Module"),
        (lambda: ro.init_weights(lin, init_fn=3), "init_weights: init_fn must be a function"),
        (lambda: ro.match_layout(lin, "x"), "match_layout: like must be an nn.Module"),
        (lambda: ro.get_full_state_dict([lin]), "get_full_state_dict: model must be an nn.Module"),
        (lambda: ro.muon_param_groups([lin.weight]), "muon_param_groups: takes the model"),
    ]
    for call, text in cases:
        with pytest.raises(TypeError, match=text):
            call()


def test_fsdp2_keywords_other_than_no_offload_are_refused_by_name():
    """accelerate passes FSDP2's keywords: the values that mean nothing for us are taken, the others named (on main:
    ``TypeError: fully_shard() got an unexpected keyword argument 'offload_policy'`` for any of them)."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.tensor import Shard

    offload = _err(lambda: fully_shard(Net(), offload_policy=CPUOffloadPolicy()))
    assert offload.startswith("NotImplementedError") and "CPU offload is not supported" in offload
    placement = _err(lambda: fully_shard(Net(), shard_placement_fn=lambda p: Shard(0)))
    assert placement.startswith("NotImplementedError") and "shard_placement_fn" in placement
    ignored = _err(lambda: fully_shard(Net(), ignored_params="a.weight"))
    assert ignored.startswith("TypeError") and "ignored_params" in ignored


def _ignored_params_like_fsdp2(rank, world):
    from torch.distributed.fsdp import OffloadPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out = {}
    for name, shard in (("ours", fully_shard), ("torch", torch_fully_shard)):
        torch.manual_seed(0)
        model = Net()
        shard(model, offload_policy=OffloadPolicy(), ignored_params={model.b.bias})
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        model(x).square().sum().backward()
        bias = model.b.bias
        out[name] = (type(bias).__name__, bias.grad.clone(), full_tensor(model.a.weight.grad))
    return out


def test_ignored_params_stay_plain_and_unreduced_as_in_fsdp2():
    for got in run_on_ranks(_ignored_params_like_fsdp2, WORLD):
        (ours_type, ours_bias_grad, ours_grad), (torch_type, torch_bias_grad, torch_grad) = got["ours"], got["torch"]
        assert ours_type == torch_type == "Parameter"
        assert torch.equal(ours_bias_grad, torch_bias_grad)  # this rank's own grad: not reduced on either side
        assert torch.equal(ours_grad, torch_grad)
