"""`bench muon`: the optimizer step of Muon on a stack of mixed-shape matrices, ours on our ``fully_shard`` against
``torch.optim.Muon`` on PyTorch FSDP2 (DTensor ``Shard(0)`` params), in the same ``run_on_ranks`` call.

The model is a chain of bias-free ``nn.Linear`` layers (10 matrices: 1024x256, 256x1024, 512x256, 512x512, ...),
one FSDP unit per layer plus the (empty) root. Each step runs forward + backward on every model (untimed), then
times ``opt.step()`` alone with a barrier on each side; the sides alternate which goes first. Step 0 is the
counted warmup (``count_collectives`` around ``opt.step()``, which sees DTensor's functional collectives as well
as torch.distributed calls). Rank 0 then replays the steps in one process with ``ragged_optim.optim.Muon`` and
compares (relative to the size of the total update).

Ours runs twice, on two copies of the model: with its default ``ns_matmul="auto"`` (``speedup``: what a user gets)
and with ``ns_matmul="native"``, torch's own bf16 matmuls (``speedup_same_ns_matmul``: the distributed design
alone). On a GPU both are the same kernel; on a CPU without a bf16 GEMM "auto" means fp32 matmuls on bf16-rounded
operands, and the gap between the two speedups is that kernel choice.

torch.optim.Muon takes DTensor params in torch 2.13: its Newton-Schulz runs through DTensor ops, which
redistribute (all-gather / all-reduce) inside the iteration. Should it raise, ``torch_status`` carries the error
and the baseline becomes "gather each full update with ``full_tensor()`` and run torch's Newton-Schulz on every
rank" (``_GatherFullMuon``).
"""

from __future__ import annotations

import torch
from torch import nn

from ragged_optim.bench.common import comm_figures, median, timed
from ragged_optim.comm.counter import count_collectives
from ragged_optim.train import shard_model

DESCRIPTION = "Muon optimizer step on 10 mixed-shape matrices: ours vs torch.optim.Muon on FSDP2 DTensors"

#: Layer widths: the chain's weights are [DIMS[i+1], DIMS[i]], so 1024x256 and 256x1024 both occur.
DIMS = (256, 1024, 256, 512, 512, 256, 768, 256, 1024, 256, 384)
LR, MOMENTUM, WEIGHT_DECAY = 0.02, 0.95, 0.01


class MatrixChain(nn.Module):
    def __init__(self, dims=DIMS, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=False) for a, b in zip(dims[:-1], dims[1:]))
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) / layer.weight.shape[1] ** 0.5)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.tanh(x)
        return x


def _batch(step: int, batch_size: int, dims, rank: int = 0, world_size: int = 1):
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(batch_size, dims[0], generator=gen), torch.randn(batch_size, dims[-1], generator=gen)
    per = batch_size // world_size
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _loss(model, x, y):
    return (model(x) - y).square().mean()


def _ours_opt(model, ns_dtype, ns_matmul="auto"):
    from ragged_optim.optim import Muon

    return Muon(
        model.parameters(),
        lr=LR,
        momentum=MOMENTUM,
        weight_decay=WEIGHT_DECAY,
        ns_dtype=ns_dtype,
        adjust_lr="original",
        ns_matmul=ns_matmul,
    )


def _torch_opt(model):
    return torch.optim.Muon(
        model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, nesterov=True, adjust_lr_fn="original"
    )


class _GatherFullMuon:
    """Fallback baseline: torch.optim.Muon's math, with every full update gathered by ``full_tensor()`` and
    orthogonalized on every rank; each rank keeps its rows."""

    def __init__(self, params):
        self.params = list(params)
        self.bufs = {}

    @torch.no_grad()
    def step(self):
        from torch.distributed.tensor import DTensor
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

        for p in self.params:
            g = p.grad.to_local()
            buf = self.bufs.setdefault(p, torch.zeros_like(g))
            buf.lerp_(g, 1 - MOMENTUM)
            u = g.lerp(buf, MOMENTUM)
            full = DTensor.from_local(u, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
            ortho = _zeropower_via_newtonschulz(full, (3.4445, -4.7750, 2.0315), 5, 1e-7)
            rank, rows = p.device_mesh.get_local_rank(), p.to_local().shape[0]
            chunk = -(-p.shape[0] // p.device_mesh.size())  # Shard(0): rank r holds rows [r*chunk, ...)
            start = rank * chunk
            local = p.to_local()
            local.mul_(1 - LR * WEIGHT_DECAY)
            local.add_(ortho[start : start + rows].to(local.dtype), alpha=-_adjust_lr(LR, "original", p.shape))

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def _rel_diff(a: dict, b: dict, p0: dict) -> float:
    """max |a - b| over max |b - p0|, over all params: the difference relative to the size of the update."""
    num = max((a[n] - b[n]).abs().max().item() for n in b)
    den = max((b[n] - p0[n]).abs().max().item() for n in b)
    return num / den if den > 0 else num


def _single(dims, batch_size, world_size, steps, ns_dtype):
    model = MatrixChain(dims)
    opt = _ours_opt(model, ns_dtype)
    for s in range(steps):
        for r in range(world_size):
            (_loss(model, *_batch(s, batch_size, dims, r, world_size)) / world_size).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _rank(rank, world_size, dims, batch_size, steps, ns_dtype, compare_single):
    import numpy as np

    from ragged_optim.kernels.newton_schulz import resolve_ns_matmul
    from ragged_optim.sharding import full_tensor, units_of
    from ragged_optim.sharding.planner import owner_compute_loads

    ours = shard_model(MatrixChain(dims), "ours")
    ours_opt = _ours_opt(ours, ns_dtype)
    native = shard_model(MatrixChain(dims), "ours")
    native_opt = _ours_opt(native, ns_dtype, ns_matmul="native")
    fsdp2 = shard_model(MatrixChain(dims), "torch")
    torch_opt, torch_status = _torch_opt(fsdp2), "ok"
    sides = {"ours": (ours, ours_opt), "ours_native": (native, native_opt), "torch": (fsdp2, torch_opt)}
    times = {name: [] for name in sides}
    counts = {}
    for s in range(steps + 1):
        x, y = _batch(s, batch_size, dims, rank, world_size)
        order = list(sides) if s % 2 == 0 else list(reversed(sides))
        for name in order:
            model, opt = sides[name]
            _loss(model, x, y).backward()
            if s == 0:
                with count_collectives() as stats:
                    try:
                        opt.step()
                    except Exception as e:  # noqa: BLE001 (torch's Muon on DTensors: report, then fall back)
                        if name != "torch":
                            raise
                        torch_status = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                        opt = _GatherFullMuon(model.parameters())
                        sides[name] = (model, opt)
                        opt.step()
                counts[name] = stats
            else:
                times[name].append(timed(opt.step))
            opt.zero_grad(set_to_none=True)
    units = units_of(ours)
    loads = sum(owner_compute_loads(u.layout) for u in units)
    muon_units = sum(1 for u in units if u.sharded_params)
    wire_itemsize = torch.empty((), dtype=ns_dtype).element_size()
    shard_wire_bytes = sum(p.numel() for p in ours.parameters()) * wire_itemsize
    out = {
        "ours_opt_step_s": median(times["ours"]),
        "torch_muon_fsdp2_opt_step_s": median(times["torch"]),
        "ours_ns_matmul": resolve_ns_matmul(ours_opt.ns_matmul, ns_dtype, next(ours.parameters()).device),
        "ours_native_ns_opt_step_s": median(times["ours_native"]),
        "ours_opt_step_times_s": times["ours"],
        "torch_opt_step_times_s": times["torch"],
        "torch_status": torch_status,
        **comm_figures({"ours": counts["ours"], "torch": counts["torch"]}),
        "units_with_muon_params": muon_units,
        "owner_compute_max_over_mean": float(loads.max() / loads.mean()) if loads.sum() > 0 else 1.0,
        "owner_compute_loads": [float(v) for v in np.asarray(loads)],
        "ours_shard_wire_bytes": shard_wire_bytes,
    }
    full_ours = {n: full_tensor(p).clone() for n, p in ours.named_parameters()}
    full_torch = {n: p.full_tensor().clone() for n, p in fsdp2.named_parameters()}
    # The parity run in fp32 Newton-Schulz (no bf16 rounding differences can hide there): ours only, untimed.
    fp32 = shard_model(MatrixChain(dims), "ours")
    fp32_opt = _ours_opt(fp32, torch.float32)
    for s in range(steps + 1):
        _loss(fp32, *_batch(s, batch_size, dims, rank, world_size)).backward()
        fp32_opt.step()
        fp32_opt.zero_grad(set_to_none=True)
    full_fp32 = {n: full_tensor(p).clone() for n, p in fp32.named_parameters()}
    if rank == 0 and compare_single:
        p0 = {n: p.detach().clone() for n, p in MatrixChain(dims).named_parameters()}
        ref = _single(dims, batch_size, world_size, steps + 1, ns_dtype)
        ref32 = _single(dims, batch_size, world_size, steps + 1, torch.float32)
        out["max_rel_diff_vs_unsharded"] = _rel_diff(full_fp32, ref32, p0)
        # its noise floor: the same one-process fp32 run with the global batch as one batch instead of W
        # micro-batches (the same sums in another order), measured here
        ref32_one_batch = _single(dims, batch_size, 1, steps + 1, torch.float32)
        out["unsharded_batching_rel_diff"] = _rel_diff(ref32_one_batch, ref32, p0)
        out[f"max_rel_diff_vs_unsharded_{str(ns_dtype).removeprefix('torch.')}"] = _rel_diff(full_ours, ref, p0)
        out["torch_max_rel_diff_vs_unsharded"] = _rel_diff(full_torch, ref, p0)
    return out


def run(
    world_size: int = 4,
    steps: int | None = None,
    *,
    scale: int = 1,
    batch_size: int | None = None,
    ns_dtype: torch.dtype = torch.bfloat16,
    compare_single: bool = True,
    timeout_s: float = 900.0,
) -> dict:
    """Run on ``world_size`` gloo ranks: a counted warmup step, then ``steps`` timed steps (default 2).
    ``scale``: divide every layer width by it (tests); ``ns_dtype``: our Newton-Schulz dtype for the timed run
    (torch.optim.Muon always uses bfloat16)."""
    from ragged_optim.comm.launch import run_on_ranks

    steps = 2 if steps is None else steps
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    dims = tuple(max(1, d // scale) for d in DIMS)
    batch_size = batch_size or 4 * world_size
    results = run_on_ranks(_rank, world_size, dims, batch_size, steps, ns_dtype, compare_single, timeout_s=timeout_s)
    out = {
        "world_size": world_size,
        "matrices": [f"{b}x{a}" for a, b in zip(dims[:-1], dims[1:])],
        "ns_dtype": str(ns_dtype).removeprefix("torch."),
        "timed_steps": steps,
        "harness": "one run_on_ranks call: 3 models per rank (ours auto, ours native NS, torch), order alternating",
    }
    out.update(results[0])
    out["speedup"] = out["torch_muon_fsdp2_opt_step_s"] / out["ours_opt_step_s"]
    out["speedup_same_ns_matmul"] = out["torch_muon_fsdp2_opt_step_s"] / out["ours_native_ns_opt_step_s"]
    out["ours_collectives_per_unit_per_step"] = out["ours_collectives_per_step"] / max(1, out["units_with_muon_params"])
    ratios = [r["ours_bytes_per_step"] / r["ours_shard_wire_bytes"] for r in results if r["ours_shard_wire_bytes"]]
    out["ours_bytes_per_rank"] = [r["ours_bytes_per_step"] for r in results]
    out["ours_bytes_over_shard_wire_max"] = max(ratios) if ratios else 0.0
    out["torch_bytes_per_rank"] = [r["torch_bytes_per_step"] for r in results]
    return out
