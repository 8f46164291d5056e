"""The bytes our runtime holds at named points of a training step's backward, term by term, counted exactly
(ragged_optim.alloc_counter) and computed from the units' layouts (issue 39). The model saves no activation for
backward (each block adds ``linear(c, w).sum(0)`` to its input: the linear saves only the buffer ``c`` and the
gathered ``w``, which exist anyway), so every byte at these points is a param, a grad or a runtime buffer.

Per block unit k, in backward order, with U_k its unsharded bytes (W*S_k elements), S_k its shard's and G_k its
params' grads as autograd makes them:

- its pre-backward allocates U_k when it gathers the unit itself (the first block in backward order) and nothing
  otherwise (its gather was issued at the previous unit's post-backward), with no temporary (the all-gather
  writes straight into the unsharded buffer);
- its post-backward frees the params (U_k) and autograd's grads (G_k), keeps the reduced shard (S_k) and gathers
  the next unit (U_{k+1}); at no moment of it is more alive than at its start, beyond a reduce-scatter receive
  buffer of S_k where it exceeds what it frees;
- the backward's peak is the end of some unit's backward: the shards reduced before it, its params and its grads.

On 212c331 the pre-backward prefetched the next unit there and gloo's all-gather held a copy of the whole output,
and its reduce-scatter all-reduced a copy of the whole unit: these figures were a unit or more higher.
"""

import gc
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ragged_optim as ro
from ragged_optim import alloc_counter
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.memory import settle
from ragged_optim.sharding import units_of
from ragged_optim.sharding.runtime import ModuleState

WIDTH, BLOCKS = 64, 3


@pytest.fixture(scope="module", autouse=True)
def counter():
    alloc_counter.install()  # built once; the forked ranks inherit it installed


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.w = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.register_buffer("c", torch.randn(1, width))

    def forward(self, x):
        return x + F.linear(self.c, self.w).sum(0)


class Chain(nn.Module):
    def __init__(self, width=WIDTH, blocks=BLOCKS):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _recorded(points):
    """Wrap ModuleState's pre- and post-backward: per call, (name, state, level before, level after, peak within)."""
    real = {"pre": ModuleState.pre_backward, "post": ModuleState.post_backward}

    def wrap(name):
        def call(self, *a, **kw):
            before = alloc_counter.current()
            outer = alloc_counter.reset_peak()
            try:
                return real[name](self, *a, **kw)
            finally:
                peak = alloc_counter.stats().peak
                alloc_counter.restore_peak(outer)
                points.append((name, self, before, alloc_counter.current(), peak))

        return call

    ModuleState.pre_backward, ModuleState.post_backward = wrap("pre"), wrap("post")
    return real


def _measured_backward(model, x):
    """One backward of ``model(x).sum()`` after a settle: its pre/post-backward points, the bytes at its start and
    its peak."""
    gc.collect()
    settle()
    points = []
    loss = model(x).sum()
    real = _recorded(points)
    try:
        start = alloc_counter.current()
        outer = alloc_counter.reset_peak()
        loss.backward()
        peak = alloc_counter.stats().peak
        alloc_counter.restore_peak(outer)
    finally:
        ModuleState.pre_backward, ModuleState.post_backward = real["pre"], real["post"]
    return points, start, peak


def _step_points(rank, world_size):
    model = Chain()
    for b in model.blocks:
        ro.fully_shard(b)
    ro.fully_shard(model)
    x = torch.randn(WIDTH, requires_grad=True)
    model(x).sum().backward()  # a first step: lazy init
    for p in [*model.parameters(), x]:
        p.grad = None
    points, start, peak = _measured_backward(model, x)
    blocks = list(model.blocks)
    sizes = []
    for b in model.blocks:
        (u,) = [u for u in units_of(model) if u.module is b]
        sizes.append((u.layout.total_size * 4, u.layout.shard_size * 4, sum(4 * p.numel() for p in b.parameters())))
    rows = [(name, blocks.index(s.module) if s.module is not model else None, before - start, after - start,
             pk - start) for name, s, before, after, pk in points]  # fmt: skip
    return {"rows": rows, "sizes": sizes, "peak": peak - start}


def test_backward_bytes_term_by_term():
    for got in run_on_ranks(_step_points, 2):
        U, S, G = zip(*got["sizes"])  # per block: unsharded, shard, autograd's grads (bytes)
        rows = got["rows"]
        # the loss's grad (one fp32 scalar, made by backward()) is alive at every point below
        eps = rows[0][2]
        assert eps == 4, rows
        pre = {k: r for r in rows if r[0] == "pre" and (k := r[1]) is not None}
        post = {}
        for r in rows:  # (the end-of-backward callback calls post-backward again: nothing left to do there)
            if r[0] == "post" and r[1] is not None:
                post.setdefault(r[1], r)
        order = [r[1] for r in rows if r[0] == "pre" and r[1] is not None]
        assert order == list(range(BLOCKS))[::-1], rows
        reduced = 0  # bytes of the shards reduced so far
        for i, k in enumerate(order):
            _, _, before, after, peak = pre[k]
            gathered = U[k] if i == 0 else 0  # later units were gathered at the previous post-backward
            assert (after - before, peak - before) == (gathered, gathered), (k, pre[k])
            _, _, entry, exit_, peak = post[k]
            assert entry == eps + reduced + U[k] + G[k], (k, post[k], rows)
            reduced += S[k]
            following = U[order[i + 1]] if i + 1 < len(order) else 0
            assert exit_ == eps + reduced + following, (k, post[k], rows)
            assert peak == entry, (k, post[k])  # nothing in the post-backward outlives what it frees
        # The backward's peak: the end of the last unit's backward (every other shard reduced, its params, its
        # grads), plus one WIDTH-vector of fp32 that autograd makes for a moment there (the linear's output grad,
        # an expanded vector made contiguous for the matmul).
        last = order[-1]
        assert got["peak"] == eps + sum(S) - S[last] + U[last] + G[last] + 4 * WIDTH, got


MATRICES = 8


class MatricesBlock(nn.Module):
    """MATRICES params, so a unit's grads make that many buckets (BUCKET_BYTES: one matrix); no saved activation."""

    def __init__(self, width):
        super().__init__()
        self.ws = nn.ParameterList(nn.Parameter(torch.randn(width, width) / width**0.5) for _ in range(MATRICES))
        self.register_buffer("c", torch.randn(1, width))

    def forward(self, x):
        for w in self.ws:
            x = x + F.linear(self.c, w).sum(0)
        return x


def _bucketed_points(rank, world_size, bucket_bytes, only_at_peak=False, n_blocks=BLOCKS):
    """As _step_points, for MatricesBlock units whose grads go in buckets (``bucket_bytes``; None: whole; with
    ``only_at_peak`` the units the runtime picks). Each grad hook waits until its bucket is summed on every rank, so
    what is alive at each point is exact."""
    from ragged_optim.sharding import grad_buckets

    grad_buckets.BUCKET_BYTES, grad_buckets.ONLY_AT_PEAK = bucket_bytes, only_at_peak
    torch.manual_seed(0)
    model = nn.Sequential(*[MatricesBlock(WIDTH) for _ in range(n_blocks)])
    for b in model:
        ro.fully_shard(b)
    ro.fully_shard(model)
    x = torch.randn(WIDTH, requires_grad=True)
    model(x).sum().backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    for p in [*model.parameters(), x]:
        p.grad = None
    points, start, peak = _measured_backward(model, x)
    blocks, sizes = list(model), []
    for b in model:
        (u,) = [u for u in units_of(model) if u.module is b]
        s, lay = u.layout.shard_size, u.layout
        # per matrix (one bucket each): its grad's bytes, and the bytes of its range this rank sums
        ranges = [(lay.offsets[i], lay.offsets[i] + math.prod(lay.shapes[i])) for i in range(len(lay.shapes))]
        own = [4 * max(0, min(hi, (rank + 1) * s) - max(lo, rank * s)) for lo, hi in ranges]
        parts = [4 * (hi - lo) for lo, hi in grad_buckets.plan_parts(lay, 4)][::-1]  # in backward order
        sizes.append((lay.total_size * 4, s * 4, [4 * p.numel() for p in b.parameters()], own, parts))
    rows = [(name, blocks.index(s.module) if s.module is not model else None, before - start, after - start,
             pk - start) for name, s, before, after, pk in points]  # fmt: skip
    bucketed = [b for b in range(n_blocks) if [u for u in units_of(model) if u.module is blocks[b]][0].buckets.wanted]
    return {"rows": rows, "sizes": sizes, "peak": peak - start, "grads": grads, "bucketed": bucketed}


def _bucketed_peak_in(U, parts, grads, own, recv, width=WIDTH):
    """The highest point of a bucketed unit's backward (above what it started with) whose params go part by part:
    while autograd makes grad j (the j-th in backward order) the unit holds the parts not yet freed, the shares it
    summed so far, grad j and a WIDTH-vector autograd makes then; while bucket j is summed, part j is gone, its
    share and one receive buffer of it are there, and grad j is still in flight."""
    highest, freed, summed = 0, 0, 0
    for b, g, o in zip(parts, grads, own):
        highest = max(highest, U - freed + summed + g + 4 * width)
        freed, summed = freed + b, summed + o
        highest = max(highest, U - freed + summed + g + recv * o)
    return highest


def test_bucketed_backward_bytes_term_by_term():
    """With grads reduced in buckets as they come, a unit's grads do not wait for its backward's end, and its
    params go part by part as their grads are taken: at its post-backward it holds only the reduced shard being
    filled (S), where the whole-unit reduction held its params and all its grads (U + G). While a bucket is summed,
    its grad and one receive buffer of the part this rank sums are alive (none where rank 0's part is the only one
    to receive: it lands in the shard itself). The result is the whole-unit reduction's, bit for bit. Fails with
    buckets off (None: U + G at every post-backward entry) and with the params freed only at the post-backward
    (grad_buckets.FREE_PARAMS_IN_BACKWARD = False, the code before it: U + S there)."""
    world = 4
    whole = run_on_ranks(_bucketed_points, world, None)
    got_all = run_on_ranks(_bucketed_points, world, 4 * WIDTH * WIDTH)
    for rank, (got, ref) in enumerate(zip(got_all, whole)):
        assert all(torch.equal(a, b) for a, b in zip(got["grads"], ref["grads"]))
        U, S, grads, own, parts = zip(*got["sizes"])
        receive_bufs = min(1, world - 1 if rank == 0 else world - 2)
        rows = got["rows"]
        eps = rows[0][2]
        pre = {r[1]: r for r in rows if r[0] == "pre" and r[1] is not None}
        post = {}
        for r in rows:
            if r[0] == "post" and r[1] is not None:
                post.setdefault(r[1], r)
        order = [r[1] for r in rows if r[0] == "pre" and r[1] is not None]
        assert order == list(range(BLOCKS))[::-1], rows
        reduced = 0
        for i, k in enumerate(order):
            _, _, before, after, peak = pre[k]
            gathered = U[k] if i == 0 else 0
            assert (after - before, peak - before) == (gathered, gathered), (rank, k, pre[k])
            _, _, entry, exit_, peak = post[k]
            assert entry == eps + reduced + S[k], (rank, k, post[k], rows)
            reduced += S[k]
            following = U[order[i + 1]] if i + 1 < len(order) else 0
            assert exit_ == eps + reduced + following, (rank, k, post[k], rows)
            # the summed shares are copied into the reduced shard, then the next unit is gathered
            assert peak == max(entry + S[k], exit_), (rank, k, post[k])
        # The peak: in the last unit's backward (params in backward order: descending offset)
        last = order[-1]
        inside = _bucketed_peak_in(U[last], parts[last], grads[last][::-1], own[last][::-1], receive_bufs)
        assert got["peak"] == eps + sum(S) - S[last] + inside, (rank, got["peak"], inside)
        assert got["peak"] < ref["peak"], (got["peak"], ref["peak"])


def test_buckets_only_where_the_peak_is():
    """The runtime buckets only the units whose whole-unit reduction would top the bucketed backward's peak (the
    last in backward order, beside the most reduced shards): the same peak to the byte as buckets in every unit,
    the same grads bit for bit, and the units early in backward reduce whole (each bucket costs a wait for the
    peers). Fails where every unit is bucketed (ONLY_AT_PEAK=False: every block listed) or none is (a higher
    peak)."""
    blocks = 8
    whole = run_on_ranks(_bucketed_points, 4, None, False, blocks)
    everywhere = run_on_ranks(_bucketed_points, 4, 4 * WIDTH * WIDTH, False, blocks)
    at_peak = run_on_ranks(_bucketed_points, 4, 4 * WIDTH * WIDTH, True, blocks)
    for got, ref, off in zip(at_peak, everywhere, whole):
        assert all(torch.equal(a, b) for a, b in zip(got["grads"], ref["grads"]))
        assert got["peak"] == ref["peak"] < off["peak"], (got["peak"], ref["peak"], off["peak"])
        assert ref["bucketed"] == list(range(blocks))
        # the blocks whose backward comes last (block 0's is the last of all), not the first ones
        assert got["bucketed"] == list(range(len(got["bucketed"]))) and 0 < len(got["bucketed"]) < blocks, got
