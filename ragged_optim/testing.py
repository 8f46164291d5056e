"""Property-test a sharded optimizer (ours or yours) against its one-process run.

    from ragged_optim.testing import assert_sharded_matches_single, world_sizes
    from hypothesis import given

    @given(world_size=world_sizes(max_size=6))
    def test_my_optimizer(world_size):
        assert_sharded_matches_single(make_model, lambda m: MyOptimizer(m.parameters()), world_size=world_size)

The helpers run real gloo ranks on this machine (``run_on_ranks``); the one-process run is the reference.
"""

from __future__ import annotations

import contextlib
import traceback
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ragged_optim.comm.launch import RankFailure, run_on_ranks
from ragged_optim.sharding import full_tensor, fully_shard, shard_info

__all__ = [
    "RankFailure",
    "ShardedMismatch",
    "assert_sharded_matches_single",
    "default_grad",
    "host_reads",
    "matrix_shapes",
    "run_on_ranks",
    "set_full_grad",
    "world_sizes",
]


def world_sizes(min_size: int = 1, max_size: int = 8):
    """A hypothesis strategy for world sizes, odd ones included."""
    from hypothesis import strategies as st

    if not (isinstance(min_size, int) and isinstance(max_size, int) and 1 <= min_size <= max_size):
        raise ValueError(
            f"world_sizes(min_size={min_size!r}, max_size={max_size!r}): world sizes are ints with "
            "1 <= min_size <= max_size"
        )
    return st.integers(min_size, max_size)


def matrix_shapes(max_dim: int = 48, stacks: bool = True):
    """A hypothesis strategy for param shapes: tall, wide, 1 x N, N x 1, and (optionally) [E, R, C] stacks."""
    from hypothesis import strategies as st

    mats = st.tuples(st.integers(1, max_dim), st.integers(1, max_dim))
    if not stacks:
        return mats
    return st.one_of(mats, st.tuples(st.integers(1, 4), st.integers(1, max_dim // 2), st.integers(1, max_dim // 2)))


def default_grad(step: int, name: str, shape: torch.Size) -> torch.Tensor:
    """A deterministic full gradient for (step, param name), the same in every process."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}:{step}".encode()))
    return torch.randn(tuple(shape), generator=g)  # (a tuple: a 0-d param's shape is ())


class ShardedMismatch(AssertionError):
    """The sharded run left the one-process run; the message names the first step and param that differ."""


@dataclass
class _Diff:
    step: int
    name: str
    shape: tuple
    max_abs: float
    index: tuple
    sharded: float
    single: float


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full_tensor(p).detach().clone() for n, p in model.named_parameters()}


def set_full_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    """Give ``p`` this rank's part of the full gradient ``g`` (the same on every rank): its local range of a
    ragged-sharded param, a DTensor distributed like an FSDP2 param, ``g`` itself for a plain tensor."""
    info = shard_info(p)
    g = g.to(p.dtype)
    if info is not None:
        p.grad = info.unit.as_ragged(p.local_part_of(g).clone(), info.index)
    elif hasattr(p, "device_mesh"):  # (torch's distribute_tensor refuses an uneven _StridedShard: FSDP2 + TP's)
        from torch.distributed.tensor import DTensor

        from ragged_optim.sharding.dtensor_layout import dtensor_layout

        piece = dtensor_layout(p).local_of_full(g).view(p.to_local().shape).clone()
        p.grad = DTensor.from_local(
            piece, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    else:
        p.grad = g


def _set_grads(model: nn.Module, step: int, grad_fn) -> None:
    for name, p in model.named_parameters():
        if p.requires_grad:
            info = shard_info(p)
            set_full_grad(p, grad_fn(step, name, info.shape if info is not None else p.shape))


def _run(model_fn, optimizer_fn, steps, grad_fn, shard_fn=None):
    model = model_fn()
    if shard_fn is not None:
        shard_fn(model)
    opt = optimizer_fn(model)
    history = [_snapshot(model)]  # the initial weights: entry 0
    for step in range(steps):
        _set_grads(model, step, grad_fn)
        opt.step()
        opt.zero_grad()
        history.append(_snapshot(model))
    return history


def _sharded(rank, world_size, model_fn, optimizer_fn, steps, grad_fn, shard_fn):
    history = _run(model_fn, optimizer_fn, steps, grad_fn, shard_fn)
    return history if rank == 0 else None


def _ragged_shard(model: nn.Module) -> None:
    fully_shard(model)


def _first_mismatch(sharded, single, rtol, atol) -> _Diff | None:
    for step, (a_step, b_step) in enumerate(zip(sharded, single)):
        for name, b in b_step.items():
            a = a_step[name]
            diff = (a - b).abs()
            bound = atol + rtol * b.abs()
            # not "diff > bound": a NaN on one side only compares False and passed (both NaN: equal)
            off = ~(diff <= bound) & ~(a.isnan() & b.isnan())
            if diff.numel() and bool(off.any()):
                flat = int(torch.nonzero(off.reshape(-1))[0])  # the first in row-major order, as documented
                index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), b.shape)) if b.ndim else ()
                return _Diff(
                    step,
                    name,
                    tuple(b.shape),
                    float(diff.max()),
                    index,
                    float(a.reshape(-1)[flat]),
                    float(b.reshape(-1)[flat]),
                )
    return None


def assert_sharded_matches_single(
    model_fn: Callable[[], nn.Module],
    optimizer_fn: Callable[[nn.Module], torch.optim.Optimizer],
    *,
    world_size: int,
    steps: int = 3,
    rtol: float = 0.0,
    atol: float = 0.0,
    grad_fn: Callable[[int, str, torch.Size], torch.Tensor] = default_grad,
    shard_fn: Callable[[nn.Module], None] | None = None,
    timeout_s: float = 120.0,
) -> None:
    """Run ``optimizer_fn(model)`` for ``steps`` steps on one process and on ``world_size`` gloo ranks with the
    model sharded by ``shard_fn`` (default: ``ragged_optim.fully_shard(model)``; pass one that calls torch's
    ``fully_shard`` to test FSDP2), feeding both the same full gradients (``grad_fn(step, name, shape)``; each
    rank gets its slice). Params are compared after every step; the first one outside ``atol + rtol * |single|``
    raises ``ShardedMismatch`` with its step, name, index and both values.

    ``model_fn`` must build the same model in every process (seed inside it). The one-process run uses one thread,
    as each rank does: a kernel's result may depend on how many threads split its reduction."""
    if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
        raise ValueError(f"assert_sharded_matches_single: steps must be an int >= 1 (steps to compare), got {steps!r}")
    for name, tol in (("rtol", rtol), ("atol", atol)):
        if not (isinstance(tol, int | float) and not isinstance(tol, bool) and tol >= 0):
            raise ValueError(f"assert_sharded_matches_single: {name} must be a number >= 0, got {tol!r}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = _run(model_fn, optimizer_fn, steps, grad_fn)
    finally:
        torch.set_num_threads(threads)
    sharded = run_on_ranks(
        _sharded,
        world_size,
        model_fn,
        optimizer_fn,
        steps,
        grad_fn,
        shard_fn or _ragged_shard,
        timeout_s=timeout_s,
    )[0]
    d = _first_mismatch(sharded, single, rtol, atol)
    if d is not None and d.step == 0:
        raise ShardedMismatch(
            f"the sharded model (world_size={world_size}) starts from other weights than the one-process model: "
            f"param {d.name!r} {d.shape} differs by {d.max_abs:.3g} before the first step (at index {d.index} "
            f"sharded {d.sharded:.9g} vs single {d.single:.9g}). model_fn must build the same model in every "
            "process: seed inside it (torch.manual_seed(0) first thing)"
        )
    if d is not None:
        d.step -= 1  # (entry 0 is the initial weights)
        raise ShardedMismatch(
            f"sharded run (world_size={world_size}) differs from the one-process run at step {d.step}, "
            f"param {d.name!r} {d.shape}: max |diff| {d.max_abs:.3g}; at index {d.index} sharded {d.sharded:.9g} vs "
            f"single {d.single:.9g} (rtol={rtol}, atol={atol})"
        )


# ------------------------------------------------------------------------------------------- host reads (syncs)

# Ops whose result the host must read from the tensor's data: on a GPU each is a device-to-host sync.
_HOST_READ_OPS = ("_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "_unique2",
                  "unique_consecutive", "unique_dim", "repeat_interleave")  # fmt: skip


@dataclass
class HostRead:
    """One read of tensor data by the host: the op and the innermost call site in this library (or yours)."""

    op: str
    site: str

    def __str__(self) -> str:
        return f"{self.op} at {self.site}"


@contextlib.contextmanager
def host_reads(allow=()) -> Iterator[list[HostRead]]:
    """Record every read of tensor data by the host while the block runs: what would be a device sync on a GPU
    (``.item()``, ``bool(t)``, ``float(t)``, ``.tolist()``, ``nonzero``, data-dependent shapes), found on any
    device, CPU included, so a CPU test can check that a training step never waits for the device.

    ``allow``: tensors that live on the host by design (an optimizer's ``state[p]["step"]`` counters, a CPU lr
    tensor); reading them is not counted. ``with host_reads(allow=steps) as reads: opt.step()``, then
    ``assert not reads, reads``. Reads inside a kernel's own C++ code (``torch.linalg.eigh``'s error check) are
    not seen."""
    from torch.utils._python_dispatch import TorchDispatchMode

    allowed = {id(t) for t in allow}
    reads: list[HostRead] = []

    def note(op: str, args) -> None:
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and id(first) in allowed:
            return
        frames = [f for f in traceback.extract_stack() if "/torch/" not in f.filename and f.filename != __file__]
        site = f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else "?"
        reads.append(HostRead(op, site))

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in _HOST_READ_OPS:
                note(func.overloadpacket.__name__, args)
            return func(*args, **(kwargs or {}))

    tolist = torch.Tensor.tolist

    def counted_tolist(t):  # tolist reads the data without going through the dispatcher
        note("tolist", (t,))
        return tolist(t)

    torch.Tensor.tolist = counted_tolist
    try:
        with _Mode():
            yield reads
    finally:
        torch.Tensor.tolist = tolist
