"""gloo's all-gather and reduce-scatter as point-to-point messages (comm/collectives.py): the results (a sum in rank
order, bitwise), what the counter sees (one collective each, the usual bytes) and the bytes they allocate, counted
exactly: none for the all-gather, at most two receive buffers of the output's size for the reduce-scatter (gloo's
own all-gather gathers into a new buffer of the whole output, its reduce-scatter all-reduces a copy of the whole
input)."""

import pytest
import torch
import torch.distributed as dist

from ragged_optim import alloc_counter
from ragged_optim.comm.collectives import all_gather_flat, p2p_serves, reduce_scatter_flat
from ragged_optim.comm.counter import count_collectives
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.memory import peak_bytes

N = 1000  # elements per rank's piece


@pytest.fixture(scope="module", autouse=True)
def counter():
    alloc_counter.install()


def _inputs(rank, world_size):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(N, generator=g), torch.randn(world_size * N, generator=g)


def _collectives(rank, world_size):
    shard, full = _inputs(rank, world_size)
    gathered = torch.empty(world_size * N)
    reduced = torch.empty(N)
    with count_collectives() as stats:
        _, gather_peak = peak_bytes(lambda: all_gather_flat(gathered, shard, p2p=True))
        _, reduce_peak = peak_bytes(lambda: reduce_scatter_flat(reduced, full, p2p=True))
    handle = all_gather_flat(torch.empty(world_size * N), shard, async_op=True, p2p=True)
    handle.wait()
    return gathered, reduced, stats.as_dict(), gather_peak, reduce_peak, p2p_serves(None, torch.device("cpu"))


@pytest.mark.parametrize("world_size", [2, 3])
def test_p2p_gather_and_reduce_scatter(world_size):
    inputs = [_inputs(r, world_size) for r in range(world_size)]
    want_gather = torch.cat([s for s, _ in inputs])
    want_sum = inputs[0][1].clone()
    for _, full in inputs[1:]:
        want_sum += full  # rank order: ((x_0 + x_1) + x_2)
    for rank, (gathered, reduced, stats, gather_peak, reduce_peak, serves) in enumerate(
        run_on_ranks(_collectives, world_size)
    ):
        assert serves
        assert torch.equal(gathered, want_gather)
        assert torch.equal(reduced, want_sum[rank * N : (rank + 1) * N])
        assert stats["calls"] == {"all_gather": 1, "reduce_scatter": 1}
        assert stats["bytes"] == {"all_gather": 4 * world_size * N, "reduce_scatter": 4 * world_size * N}
        assert gather_peak == 0
        spares = min(2, sum(1 for k in range(1, world_size) if k != rank))  # rank 0's piece lands in the output
        assert reduce_peak == spares * 4 * N, (rank, reduce_peak)


def test_p2p_is_for_gloo_cpu_groups_only():
    assert not p2p_serves(None, torch.device("cpu"))  # no process group here
    assert not dist.is_initialized()


def _gather_into_parts(rank, world_size, cuts):
    shard, _ = _inputs(rank, world_size)
    bounds = [0, *cuts, world_size * N]
    parts = [torch.empty(hi - lo) for lo, hi in zip(bounds, bounds[1:])]
    with count_collectives() as stats:
        _, peak = peak_bytes(lambda: all_gather_flat(parts, shard, p2p=True))
    try:
        all_gather_flat(parts[:-1], shard, p2p=True)
        short = ""
    except ValueError as e:
        short = str(e)
    return torch.cat(parts), stats.as_dict(), peak, short


@pytest.mark.parametrize("world_size", [2, 3])
def test_p2p_gather_into_parts(world_size):
    """The all-gather into a list of tensors with storages of their own (a unit's params in parts, freed one by one
    in backward), cut anywhere (inside a rank's piece, at its edge, a part inside one piece): the flat gather's
    result, counted as one all-gather of the same bytes, no buffer besides the parts; a list that does not hold
    W x S elements is refused."""
    want = torch.cat([_inputs(r, world_size)[0] for r in range(world_size)])
    for cuts in ([N // 3], [N, N + 7, N + 8], [5, 2 * N - 1]):
        cuts = [c for c in cuts if c < world_size * N]
        for gathered, stats, peak, short in run_on_ranks(_gather_into_parts, world_size, cuts):
            assert torch.equal(gathered, want), cuts
            assert stats["calls"] == {"all_gather": 1} and stats["bytes"] == {"all_gather": 4 * world_size * N}
            assert peak == 0
            assert "not world x shard" in short, short
