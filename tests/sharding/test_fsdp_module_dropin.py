"""``ro.fully_shard`` units are torch ``FSDPModule``s, and the methods frameworks call on them work (issue 33, parts
2 and 3). On main they were not FSDPModules: torchtitan's ``set_gradient_divide_factor(1.0)`` on every
``isinstance(m, FSDPModule)`` was skipped with no error and every grad was 1/W of FSDP2's; and
``fully_shard([model.norm, model.head])`` was refused. Torch FSDP2 runs the same model in the same process as the
control: the grads must equal its grads bit for bit (same sums, same divisions)."""

import pytest
import torch
from noise_bounds import allowed, max_abs_gap
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import ragged_optim as ro
from ragged_optim.comm.counter import count_collectives
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.sharding.fully_shard import RaggedFSDPModule, state_of


class Net(nn.Module):
    """Layers, then a norm and a head that are one unit; the loss calls the head outside forward, chunk by chunk
    (as torchtitan's chunked loss does)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.norm(x)


def shard(model, fully_shard):
    for layer in model.layers:
        fully_shard(layer)
    out = fully_shard([model.norm, model.head])
    fully_shard(model)
    return model, out


def full_grads(model, ours: bool) -> dict:
    return {n: (ro.full_grad(p) if ours else p.grad.full_tensor()) for n, p in model.named_parameters()}


def loss_of(model, x):
    h = model(x)
    return sum(model.head(c).square().sum() for c in h.chunk(3))


def grads_like_fsdp2(rank, world, factor):
    out = {}
    for kind, fully_shard in (("ours", ro.fully_shard), ("fsdp2", torch_fully_shard)):
        model, listed = shard(Net(), fully_shard)
        assert isinstance(listed, list) and all(isinstance(m, FSDPModule) for m in listed), kind
        assert all(isinstance(m, FSDPModule) for m in (model, *model.layers)), kind
        if factor is not None:  # what torchtitan does, on every FSDPModule
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_gradient_divide_factor(factor)
                    m.set_force_sum_reduction_for_comms(True)  # (FSDP2 on gloo: no AVG, no PREMUL_SUM)
        for x in inputs(rank):  # two backwards: the second accumulates
            loss_of(model, x).backward()
        out[kind] = full_grads(model, kind == "ours")
    # one process, every rank's inputs, summed in another order: the scale of rounding differences
    single = Net()
    for r in range(world):
        for x in inputs(r):
            loss_of(single, x).backward()
    divisor = world if factor is None else factor
    out["single"] = {n: p.grad / divisor for n, p in single.named_parameters()}
    return out if rank == 0 else None


def inputs(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(6, 8, generator=g) for _ in range(2)]


@pytest.mark.parametrize("world,factor", [(2, None), (2, 1.0), (2, 2.5), (3, 1.0)])
def test_units_are_fsdp_modules_and_grads_follow_the_divide_factor(world, factor):
    """At 2 ranks a sum of two is the same in any order: bitwise FSDP2's. At 3, gloo sums FSDP2's grads (an
    all-reduce of a copy) in another order than ours: within the gap FSDP2 has to a one-process run."""
    got = run_on_ranks(grads_like_fsdp2, world, factor)[0]
    ours, fsdp2, single = got["ours"], got["fsdp2"], got["single"]
    assert sorted(ours) == sorted(fsdp2)
    if world == 2:
        for k, want in fsdp2.items():
            assert torch.equal(ours[k], want), (k, (ours[k] - want).abs().max().item())
    scale = max(v.abs().max().item() for v in fsdp2.values())
    assert max_abs_gap(ours, fsdp2) <= allowed(max_abs_gap(fsdp2, single), scale)


def test_every_fsdp_module_method_is_ours():
    """Each public method of torch's FSDPModule is implemented or refused here: none reaches torch's, which reads
    FSDP2's private state (an AttributeError deep inside, or a silent no-op)."""
    public = [n for n in dir(FSDPModule) if not n.startswith("_") and callable(getattr(FSDPModule, n))]
    assert "set_gradient_divide_factor" in public
    inherited = [n for n in public if getattr(RaggedFSDPModule, n) is getattr(FSDPModule, n)]
    assert not inherited, f"FSDPModule methods that fall through to torch's: {inherited}"


def methods(rank, world):
    out = {}
    # reshard_after_backward=False: kept after backward, reused by the next micro-batch, gathered after a step
    runs = {}
    for keep in (False, True):
        model, _ = shard(Net(), ro.fully_shard)
        layer = model.layers[1]
        layer.set_reshard_after_backward(not keep, recurse=False)
        unit = state_of(layer).units[0]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(7)
        losses, kept = [], []
        with count_collectives() as stats:
            for _step in range(2):
                for _micro in range(2):
                    loss = loss_of(model, torch.randn(6, 8))
                    loss.backward()
                    losses.append(loss.detach())
                    kept.append(unit.is_unsharded)
                opt.step()
                opt.zero_grad()
        runs[keep] = (torch.stack(losses), kept, stats.calls["all_gather"])
    out["kept"] = runs[True][1], runs[False][1]
    out["same_losses"] = torch.equal(runs[True][0], runs[False][0])
    out["gathers"] = runs[True][2], runs[False][2]
    # explicit prefetch: layer 0 prefetches layers 1 and 2 at its forward; the head's unit prefetches layer 2's in
    # backward
    model, listed = shard(Net(), ro.fully_shard)
    model.layers[0].set_modules_to_forward_prefetch([model.layers[1], model.layers[2]])
    seen = {}

    def after_layer0(_m, _args, _out):
        seen["forward"] = [state_of(m).units[0].pending_gather is not None for m in model.layers[1:]]

    model.layers[0].register_forward_hook(after_layer0)
    model(torch.randn(2, 8)).sum().backward()
    out["forward_prefetch"] = seen["forward"]
    # bad input
    errors = {}
    for call in (
        lambda: model.set_gradient_divide_factor(0),
        lambda: model.set_reshard_after_backward("no"),
        lambda: model.set_modules_to_forward_prefetch([nn.Linear(2, 2)]),
        lambda: model.set_custom_all_gather(None),
        lambda: model._get_fsdp_state()._fsdp_param_groups,
    ):
        try:
            call()
            errors[len(errors)] = None
        except (ValueError, TypeError, NotImplementedError) as e:
            errors[len(errors)] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    model.set_requires_all_reduce(True)  # no replicas: accepted, as FSDP2 does
    model.set_is_last_backward(True)
    return out if rank == 0 else None


def test_fsdp_module_methods_work_or_say_why():
    got = run_on_ranks(methods, 2)[0]
    assert got["kept"] == ([True] * 4, [False] * 4)  # gathered after each backward; by default never
    assert got["same_losses"]
    kept, default = got["gathers"]
    assert kept == default - 2  # the second micro-batch of each step reuses layer 1's gathered params
    assert got["forward_prefetch"] == [True, True]
    e = got["errors"]
    assert "set_gradient_divide_factor(factor=0)" in e[0]
    assert "set_reshard_after_backward(reshard_after_backward='no')" in e[1]
    assert "not a ragged_optim.fully_shard module" in e[2]
    assert e[3].startswith("NotImplementedError: set_custom_all_gather") and "comm_policy" in e[3]
    assert "no torch FSDP2 state ('_fsdp_param_groups'" in e[4]


def bad_lists(rank, world):
    model = Net()
    errors = []
    for arg in ([], [model.norm, 3], [model.norm, model.norm], [model, model.norm]):
        try:
            ro.fully_shard(arg)
            errors.append(None)
        except (TypeError, ValueError) as e:
            errors.append(str(e))
    return errors


def test_bad_module_lists_are_named():
    errors = run_on_ranks(bad_lists, 1)[0]
    assert "empty" in errors[0]
    assert "item 1 is a int" in errors[1]
    assert "appears twice" in errors[2]
    assert "item 1 (LayerNorm) is inside item 0 (Net)" in errors[3]


def tensor_parallel_then_ours(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(8, 8))
    parallelize_module(model, mesh, {"0": ColwiseParallel()})
    try:
        ro.fully_shard(model)
    except ValueError as e:
        return str(e)
    return None


def test_fully_shard_of_a_tensor_parallel_module_says_what_to_do():
    """On main: a raw ``aten.copy_.default got mixed torch.Tensor and DTensor`` from inside the flat buffer's copy.
    TP over the whole world and no data-parallel mesh: the message says which mesh to pass (tests/
    test_tensor_parallel.py runs the composition itself)."""
    msg = run_on_ranks(tensor_parallel_then_ours, 2)[0]
    assert msg is not None and "'0.weight' is a tensor-parallel DTensor" in msg and "mesh=mesh['dp']" in msg
