"""ro.testing: the public equivalence assertion passes for correct optimizers and names the first mismatch."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from noise_bounds import allowed, magnitude, max_abs_gap
from torch import nn

import ragged_optim as ro
from ragged_optim.optim import Muon
from ragged_optim.testing import ShardedMismatch, assert_sharded_matches_single, world_sizes


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(13, 7), nn.Linear(7, 3))


class LocalNormSGD(torch.optim.Optimizer):
    """Normalises each grad by the norm of this rank's piece: correct on one process, wrong on shards (the norm of
    the DTensor grad itself would be the global one)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                grad = ro.local(p.grad)
                if grad is not None and grad.numel():
                    ro.local(p).add_(grad / grad.norm(), alpha=-g["lr"])


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


class _OneVector(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(5))


class _LocalVarianceSGD(torch.optim.Optimizer):
    """SGD times (variance / variance) of the local grad: 1 in one process, NaN on a rank holding one element."""

    def __init__(self, params):
        super().__init__(params, dict(lr=0.1))

    @torch.no_grad()
    def step(self):
        for p in self.param_groups[0]["params"]:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # (this rank's piece, on purpose)
            if g.numel():
                v = g.var()
                ro.local(p).add_(g * (v / v), alpha=-0.1)


def test_a_nan_only_the_sharded_run_makes_is_a_mismatch():
    """Before: ``diff > bound`` is False for NaN, so a sharded run ending in NaN passed. The report names the first
    index that differs (row-major), as the README says."""
    with pytest.raises(ShardedMismatch) as e:
        assert_sharded_matches_single(_OneVector, lambda m: _LocalVarianceSGD(m.parameters()), world_size=4, steps=1)
    assert "step 0" in str(e.value) and "'w'" in str(e.value) and "nan" in str(e.value), str(e.value)


def test_run_on_ranks_refuses_a_process_that_already_has_a_process_group(monkeypatch):
    """Before: every forked rank failed with ``trying to initialize the default process group twice!``."""
    from ragged_optim.testing import run_on_ranks

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="already has one"):
        run_on_ranks(print, 2)


def test_an_interrupt_kills_the_ranks():
    """Before: on KeyboardInterrupt the parent only joined each rank for 5 s and left them running (until gloo's
    timeout). A child process is interrupted while its 2 ranks sleep; none may be left."""
    import subprocess
    import sys

    script = (
        "import os, signal, threading, time, multiprocessing as mp\n"
        "from ragged_optim.testing import run_on_ranks\n"
        "def sleeper(rank, world):\n"
        "    time.sleep(60)\n"
        "threading.Timer(6.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()\n"
        "t0 = time.monotonic()\n"
        "try:\n"
        "    run_on_ranks(sleeper, 2)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', len(mp.active_children()), round(time.monotonic() - t0))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    words = out.stdout.split()
    assert words[:2] == ["interrupted", "0"], out.stdout + out.stderr
    assert int(words[2]) < 20, out.stdout  # not the 5 s join per rank, nor gloo's timeout


@pytest.mark.parametrize("bounds", [(0, 3), (-1, 2), (5, 2)])
def test_world_sizes_refuses_bounds_that_are_no_world_size(bounds):
    """Before: (0, 3) and (-1, 2) drew 0 and negative world sizes; (5, 2) failed inside hypothesis."""
    with pytest.raises(ValueError, match="1 <= min_size <= max_size"):
        world_sizes(*bounds)


class WithScalar(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.temp = nn.Parameter(torch.tensor(0.7))  # a learnable temperature: 0-d
        self.lin = nn.Linear(5, 3)


def test_default_grads_cover_a_zero_dim_param():
    """Before, ``default_grad`` called ``torch.randn(*())`` for a 0-d param and raised ``TypeError: randn() missing 1
    required positional arguments: "size"`` before any optimizer ran."""
    assert_sharded_matches_single(WithScalar, lambda m: torch.optim.AdamW(m.parameters(), lr=0.1), world_size=2)


def test_bad_arguments_and_unseeded_models_are_named():
    """Before: steps=0 (or -5) compared nothing and passed; atol=-1 reported a mismatch "max |diff| 0"; an unseeded
    model_fn was reported as the optimizer leaving the one-process run "at step 0"."""
    opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    for kw in ({"steps": 0}, {"steps": -5}, {"steps": "3"}, {"atol": -1.0}, {"rtol": float("nan")}):
        with pytest.raises(ValueError, match="assert_sharded_matches_single: (steps|atol|rtol) must be"):
            assert_sharded_matches_single(make_model, opt, world_size=2, **kw)
    with pytest.raises(ShardedMismatch, match=r"starts from other weights .* seed inside it"):
        assert_sharded_matches_single(lambda: nn.Linear(5, 3), opt, world_size=2)
