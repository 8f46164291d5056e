"""ro.testing: the public equivalence assertion passes for correct optimizers and names the first mismatch."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from noise_bounds import allowed, magnitude, max_abs_gap
from torch import nn

from ragged_optim.optim import Muon
from ragged_optim.testing import ShardedMismatch, assert_sharded_matches_single, world_sizes


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(13, 7), nn.Linear(7, 3))


class LocalNormSGD(torch.optim.Optimizer):
    """Normalises each grad by its norm: correct on one process, wrong on shards (it sees only local norms)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None and p.grad.numel():
                    p.add_(p.grad / p.grad.norm(), alpha=-g["lr"])


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(world_size=world_sizes(1, 5))
def test_elementwise_adamw_matches_bitwise(world_size):
    assert_sharded_matches_single(
        make_model, lambda m: torch.optim.AdamW(m.parameters(), lr=0.1), world_size=world_size
    )


def test_muon_matches_with_fp32_newton_schulz():
    from ragged_optim.testing import _run, default_grad

    opt = lambda m: Muon(m.parameters(), ns_dtype=torch.float32)
    # Both sides get the same full grads and each matrix is computed whole on its owner, so the only source of
    # difference is how matmuls split their sums by thread count (each rank runs one thread, this process may run
    # more). Allowed: the one-process run's own gap between one thread and this process's count, measured here.
    threads = torch.get_num_threads()
    here = _run(make_model, opt, 3, default_grad)
    torch.set_num_threads(1)
    try:
        one_thread = _run(make_model, opt, 3, default_grad)
    finally:
        torch.set_num_threads(threads)
    gap = max(max_abs_gap(a, b) for a, b in zip(here, one_thread))
    scale = max(magnitude(step) for step in here)
    assert_sharded_matches_single(make_model, opt, world_size=3, atol=allowed(gap, scale))


def test_a_shard_dependent_optimizer_is_caught_with_a_readable_report():
    with pytest.raises(ShardedMismatch, match=r"step 0, param '\d\.(weight|bias)'.*at index"):
        assert_sharded_matches_single(make_model, lambda m: LocalNormSGD(m.parameters()), world_size=3)


def test_torch_fsdp2_params_through_shard_fn():
    def fsdp2(model):
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)

    opt = lambda m: torch.optim.AdamW(m.parameters(), lr=0.1)
    assert_sharded_matches_single(make_model, opt, world_size=2, shard_fn=fsdp2)


def _wide_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 33), nn.ReLU(), nn.Linear(33, 7), nn.Linear(7, 40, bias=False))


def test_reference_run_uses_one_thread_as_the_ranks_do():
    """With the caller at 2 threads, a matmul-heavy optimizer's one-process reference split its reductions over
    threads that the ranks (one thread each) do not: Shampoo "differed" (1.9e-7 at step 0) at every world size."""
    from ragged_optim.optim import Shampoo

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert_sharded_matches_single(_wide_model, lambda m: Shampoo(m.parameters(), lr=1e-3), world_size=2)
        assert torch.get_num_threads() == 2  # the caller's setting is given back
    finally:
        torch.set_num_threads(threads)
