"""Grads reduced in buckets during the backward (sharding/grad_buckets.py), with the params freed part by part as
their grads are taken, give the whole-unit reduction's result bit for bit under the patterns people train with:
activation checkpointing (both kinds), a param that gets a grad on some ranks only, an unused param, a frozen param
between trainable ones, bf16 on the wire, gradient accumulation, and a backward that raised. The buckets here are
small (a few params each) so every unit has many; the control is the same run with buckets off
(``BUCKET_BYTES = None``) in the same processes."""

import pytest
import torch
import torch.nn.functional as F
from fsdp_models import Boom, RaiseInBackward
from torch import nn
from torch.utils.checkpoint import checkpoint

import ragged_optim as ro
from ragged_optim.comm.counter import count_collectives
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.sharding import CommPolicy, units_of

D = 24


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(D, 3 * D)
        self.l2 = nn.Linear(3 * D, D)
        self.extra = nn.Linear(D, D)  # used where use_extra (a rank's choice: MoE experts without tokens)
        self.gain = nn.Parameter(torch.ones(3))
        self.unused = nn.Parameter(torch.ones(5))
        self.use_extra = True

    def forward(self, x):
        h = self.l2(torch.relu(self.l1(x))) * self.gain.mean()
        if self.use_extra:
            h = h + self.extra(x)
        return x + h


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(D, 7)
        self.ckpt = None

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x) if self.ckpt is None else checkpoint(b, x, use_reentrant=self.ckpt == "reentrant")
        return self.head(x)


PATTERNS = ("plain", "ac", "reentrant", "some_ranks", "frozen", "bf16", "accumulate", "failed_backward")


def _train(rank, world, pattern):
    model = Model()
    if pattern == "frozen":
        for b in model.blocks:
            b.l2.weight.requires_grad_(False)
    policy = CommPolicy(grad_reduce="bf16") if pattern == "bf16" else None
    for b in model.blocks:
        ro.fully_shard(b, comm_policy=policy)
    ro.fully_shard(model, comm_policy=policy)
    model.ckpt = {"ac": "plain", "reentrant": "reentrant"}.get(pattern)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    calls = []
    for step in range(3):
        x, y = torch.randn(4, D, generator=g), torch.randint(0, 7, (4,), generator=g)
        if pattern == "some_ranks":
            model.blocks[1].use_extra = rank == step % world
        micro = 2 if pattern == "accumulate" else 1
        with count_collectives() as stats:
            for m in range(micro):
                for u in units_of(model):
                    u.requires_grad_sync = m == micro - 1
                out = model(x[m::micro])
                if pattern == "failed_backward" and step == 1:
                    out = RaiseInBackward.apply(out)
                try:
                    F.cross_entropy(out, y[m::micro]).backward()
                except Boom:
                    opt.zero_grad()
                    continue
        calls.append(stats.calls["reduce_scatter"])
        if step != 1 or pattern != "failed_backward":
            opt.step()
        opt.zero_grad()
    freed = sum(u.parts_freed_in_backward for u in units_of(model))
    return [p.full_tensor() for p in model.parameters()], calls, freed


def _both(rank, world):
    from ragged_optim.sharding import grad_buckets

    real_post, posted = grad_buckets.GradBuckets._post, []

    def post(self, b):
        posted.append(self.active)  # posted by a grad hook (True) or by the post-backward (False)
        return real_post(self, b)

    grad_buckets.GradBuckets._post = post
    grad_buckets.ONLY_AT_PEAK = False  # every unit in buckets, not only the ones at the backward's peak
    out = {}
    for pattern in PATTERNS:
        for cap in (64 * 4, None):
            grad_buckets.BUCKET_BYTES = cap
            posted.clear()
            out[pattern, cap] = (*_train(rank, world, pattern), sum(posted), len(posted))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_bucketed_grads_equal_the_whole_unit_reduction(world):
    got = run_on_ranks(_both, world)
    n_units = 4
    for rank, r in enumerate(got):
        for pattern in PATTERNS:
            (params, calls, freed, by_hook, n_posted) = r[pattern, 256]
            (ref, ref_calls, ref_freed, _, ref_posted) = r[pattern, None]
            assert all(torch.equal(a, b) for a, b in zip(params, ref)), (pattern, rank)
            assert ref_freed == 0, pattern
            # params freed part by part inside the backward from a unit's second bucketed one (a freed part read
            # would raise); a reentrant checkpoint's blocks do it in the recompute's backward, where all their
            # grads come. Not after a backward that raised before reaching the units: its forward still counts,
            # so the next backward looks like a second use and reduces whole (as no-sync accumulation does)
            assert (freed > 0) == (pattern not in ("accumulate", "failed_backward")), (pattern, freed)
            assert calls == ref_calls, (pattern, calls, ref_calls)  # one reduce-scatter per unit, bucketed or not
            assert ref_posted == 0, pattern
            if pattern == "accumulate":  # grads kept from a no-sync backward are reduced whole, with this one's
                assert n_posted == 0, pattern
            elif pattern != "reentrant":  # (a reentrant checkpoint runs the blocks' forwards without grad)
                assert by_hook > 0, (pattern, by_hook, n_posted)
        assert r["plain", 256][1] == [n_units] * 3


def test_a_grad_accumulated_again_after_its_bucket_went_is_an_error():
    """A param whose grad arrives in two graph tasks (used inside a reentrant checkpoint and outside it): its
    bucket left with the first, so the second would be lost: refused, naming the param, and the next step runs."""
    r = run_on_ranks(_twice, 2)
    for msg, after in r:
        assert "'l1.weight'" in msg and "use_reentrant=False" in msg, msg
        assert after, "the next iteration did not train"


def _twice(rank, world):
    from ragged_optim.sharding import grad_buckets

    grad_buckets.BUCKET_BYTES, grad_buckets.ONLY_AT_PEAK = 256, False

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.l1, self.l2 = nn.Linear(D, D), nn.Linear(D, D)

        def forward(self, x):  # the backward reaches l1 outside the checkpoint first, then inside it
            x = checkpoint(lambda t: self.l1(t), x, use_reentrant=True)
            return self.l2(self.l1(x))

    model = Twice()
    ro.fully_shard(model)
    x = torch.randn(4, D, requires_grad=True)  # (a reentrant checkpoint needs an input that requires grad)
    msg = ""
    try:
        model(x).sum().backward()
    except RuntimeError as e:
        msg = str(e)
    for p in model.parameters():
        p.grad = None
    grad_buckets.BUCKET_BYTES = None
    model(x).sum().backward()
    return msg, all(p.grad is not None for p in model.parameters())


def test_a_forward_inside_its_own_backward_after_params_went_is_an_error():
    """A unit's forward run again inside its own backward, after some of its params were freed there (their
    grads were all taken): refused with the unit's name and the fix, not run on freed storage, and training goes on
    with params kept to the post-backward."""
    for msg, after in run_on_ranks(_forward_in_own_backward, 2):
        assert "Again's forward ran again inside its backward" in msg and "FREE_PARAMS_IN_BACKWARD" in msg, msg
        assert after, "the next iteration did not train"


class _CallsBack(torch.autograd.Function):
    """Identity whose backward runs the module given (once), as a user's recompute inside a unit might."""

    @staticmethod
    def forward(ctx, x, module):
        ctx.module = module
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.module.calling_back:
            ctx.module.calling_back = False
            with torch.enable_grad():
                ctx.module(torch.zeros(1, D))
        return g, None


def _forward_in_own_backward(rank, world):
    from ragged_optim.sharding import grad_buckets

    grad_buckets.BUCKET_BYTES, grad_buckets.ONLY_AT_PEAK = 256, False

    class Again(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.l1, self.l2 = nn.Linear(D, D), nn.Linear(D, D)
            self.calling_back = False

        def forward(self, x):  # _CallsBack's backward comes last in this unit's backward, after every grad
            return self.l2(self.l1(_CallsBack.apply(x, self)))

    model = Again()
    ro.fully_shard(model)
    x = torch.randn(4, D, requires_grad=True)
    model(x).sum().backward()  # a clean first backward: params are freed from the next one
    msg = ""
    try:
        model.calling_back = True
        model(x).sum().backward()
    except RuntimeError as e:
        msg = str(e)
    for p in model.parameters():
        p.grad = None
    grad_buckets.FREE_PARAMS_IN_BACKWARD = False
    model.calling_back = True
    model(x).sum().backward()
    return msg, all(p.grad is not None for p in model.parameters())
