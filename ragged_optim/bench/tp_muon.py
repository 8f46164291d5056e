"""`bench tp`, its Muon part: the Muon optimizer step on torch FSDP2 + TP DTensor params, ours against
``torch.optim.Muon`` on the same params, in one ``run_on_ranks`` call (``ragged_optim.bench.tp`` runs it after the
training-step part; its keys start with ``muon_``, plus ``owner_compute_*``).

The bench20m GPT's blocks (11 x qkv 1152x384, attention proj 384x384, mlp fc 1536x384, mlp proj 384x1536) are
parallelized with torch's own TP plan on the tp dim of the (dp, tp) mesh (by default (2, 2), 4 gloo ranks):
``parallelize_module`` with qkv and fc colwise, both projs rowwise, then torch's ``fully_shard`` over the dp dim,
per block. The matrices become DTensors placed ``(_StridedShard(0, sf=2), Shard(0))`` and ``(Shard(0),
Shard(1))``. Each side gets its own copy of the blocks and the matrices only (``torch.optim.Muon`` takes 2-D params
alone). Every step gives both the same full gradients (seeded per step and name, each rank's piece of them: no
forward, so the optimizer is all that differs), then times ``opt.step()`` alone between barriers, the sides
alternating which goes first; step 0 is the counted warmup (``count_collectives`` sees DTensor's functional
collectives as well as torch.distributed calls). Rank 0 then replays the steps in one process on the full
tensors: ``ragged_optim.optim.Muon`` for ours, ``torch.optim.Muon`` for torch's.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from ragged_optim.bench.common import comm_figures, median, timed
from ragged_optim.comm.counter import count_collectives

LR, MOMENTUM, WEIGHT_DECAY = 0.02, 0.95, 0.01
TP_PLAN = ("attn.qkv", "colwise"), ("attn.proj", "rowwise"), ("mlp.fc", "colwise"), ("mlp.proj", "rowwise")


def _blocks(preset: str, scale: int, n_layers: int | None):
    """The GPT's transformer blocks (an nn.ModuleList), widths divided by ``scale`` (tests)."""
    from ragged_optim.models import GPT, get_config

    cfg = get_config(preset)
    kw = dict(d_model=max(1, cfg.d_model // scale), n_heads=1 if scale > 1 else cfg.n_heads)
    if n_layers is not None:
        kw["n_layers"] = n_layers
    cfg = get_config(preset, **kw)
    return GPT(cfg, seed=0).layers


def _parallelize(blocks: nn.ModuleList, mesh) -> nn.ModuleList:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for block in blocks:
        parallelize_module(block, mesh["tp"], {name: styles[kind]() for name, kind in TP_PLAN})
        fully_shard(block, mesh=mesh["dp"])
    return blocks


def _matrices(blocks: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in blocks.named_parameters() if p.ndim == 2]


def _grad(step: int, name: str, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{step}:{name}".encode()))
    return torch.randn(tuple(shape), generator=gen)


def _ours_opt(params, ns_dtype):
    from ragged_optim.optim import Muon

    return Muon(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, ns_dtype=ns_dtype, adjust_lr="original")


def _torch_opt(params):
    return torch.optim.Muon(
        params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, nesterov=True, adjust_lr_fn="original"
    )


def _rel_diff(a: dict, b: dict, p0: dict) -> float:
    """max |a - b| over max |b - p0|, over all params: the difference relative to the size of the update."""
    num = max((a[n] - b[n]).abs().max().item() for n in b)
    den = max((b[n] - p0[n]).abs().max().item() for n in b)
    return num / den if den > 0 else num


def _one_process(make, blocks, steps: int) -> dict:
    mats = _matrices(blocks)
    opt = make([p for _, p in mats])
    for s in range(steps):
        for n, p in mats:
            p.grad = _grad(s, n, p.shape)
        opt.step()
    return {n: p.detach().clone() for n, p in mats}


def _rank(rank, world_size, mesh_shape, preset, scale, n_layers, steps, ns_dtype, compare_single):
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_optim.sharding.owner_balance import newton_schulz_cost
    from ragged_optim.testing import set_full_grad

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
    models = {"ours": _parallelize(_blocks(preset, scale, n_layers), mesh)}
    models["torch"] = _parallelize(_blocks(preset, scale, n_layers), mesh)
    mats = {k: _matrices(m) for k, m in models.items()}
    opts = {
        "ours": _ours_opt([p for _, p in mats["ours"]], ns_dtype),
        "torch": _torch_opt([p for _, p in mats["torch"]]),
    }
    placements = sorted({str(tuple(p.placements)) for _, p in mats["ours"]})
    times = {k: [] for k in opts}
    counts = {}
    for s in range(steps + 1):
        for name in opts if s % 2 == 0 else reversed(list(opts)):
            for n, p in mats[name]:
                set_full_grad(p, _grad(s, n, p.shape))
            if s == 0:
                with count_collectives() as stats:
                    opts[name].step()
                counts[name] = stats
            else:
                times[name].append(timed(opts[name].step))
    ours = opts["ours"]
    load = sum(newton_schulz_cost(*p.shape[-2:]) * len(ours.blocks_computed_here(p)) for _, p in mats["ours"])
    out = {
        "rank": rank,
        "ours_opt_step_s": median(times["ours"]),
        "torch_opt_step_s": median(times["torch"]),
        "ours_opt_step_times_s": times["ours"],
        "torch_opt_step_times_s": times["torch"],
        **comm_figures({"ours": counts["ours"], "torch": counts["torch"]}),
        "owner_compute": load,
        "placements": placements,
        "matrices": len(mats["ours"]),
    }
    full = {k: {n: p.full_tensor().clone() for n, p in mats[k]} for k in mats}  # (collectives: every rank)
    if rank == 0 and compare_single:
        p0 = {n: p.detach().clone() for n, p in _matrices(_blocks(preset, scale, n_layers))}
        ref = _one_process(lambda ps: _ours_opt(ps, ns_dtype), _blocks(preset, scale, n_layers), steps + 1)
        ref_torch = _one_process(_torch_opt, _blocks(preset, scale, n_layers), steps + 1)
        out["muon_max_rel_diff_vs_unsharded"] = _rel_diff(full["ours"], ref, p0)
        out["torch_muon_max_rel_diff_vs_unsharded"] = _rel_diff(full["torch"], ref_torch, p0)
        out["muon_ours_vs_torch_rel_diff_unsharded"] = _rel_diff(ref, ref_torch, p0)
    return out


def muon_part(
    world_size: int = 4,
    steps: int | None = None,
    *,
    tp: int = 2,
    preset: str = "bench20m",
    scale: int = 1,
    n_layers: int | None = None,
    ns_dtype: torch.dtype = torch.bfloat16,
    compare_single: bool = True,
    timeout_s: float = 1800.0,
) -> dict:
    """Run on ``world_size`` gloo ranks as a (world_size // tp, tp) mesh: a counted warmup step, then ``steps``
    timed steps (default 2). ``scale``: divide the model width by it, ``n_layers``: fewer blocks (tests)."""
    from ragged_optim.comm.launch import run_on_ranks

    steps = 2 if steps is None else steps
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if tp < 1 or world_size % tp:
        raise ValueError(f"tp={tp} must divide world_size={world_size} (the mesh is (world_size // tp, tp))")
    mesh_shape = (world_size // tp, tp)
    results = run_on_ranks(
        _rank, world_size, mesh_shape, preset, scale, n_layers, steps, ns_dtype, compare_single, timeout_s=timeout_s
    )
    r0 = results[0]
    loads = [r["owner_compute"] for r in results]
    mean = sum(loads) / len(loads)
    out = {
        "muon_ns_dtype": str(ns_dtype).removeprefix("torch."),
        "muon_timed_steps": steps,
        "muon_matrices": r0["matrices"],
        "muon_placements": r0["placements"],
        "muon_harness": "one run_on_ranks call: 2 copies of the blocks per rank (ours, torch), same grads, alternating",
        **{f"muon_{k}": r0[k] for k in r0 if k.startswith(("ours_", "torch_")) and "rel_diff" not in k},
        "muon_speedup_vs_torch": r0["torch_opt_step_s"] / r0["ours_opt_step_s"],
        "muon_ours_bytes_per_rank": [r["ours_bytes_per_step"] for r in results],
        "muon_torch_bytes_per_rank": [r["torch_bytes_per_step"] for r in results],
        "owner_compute_loads": loads,
        "owner_compute_max_over_mean": max(loads) / mean if mean > 0 else 1.0,
    }
    for k in (
        "muon_max_rel_diff_vs_unsharded",
        "torch_muon_max_rel_diff_vs_unsharded",
        "muon_ours_vs_torch_rel_diff_unsharded",
    ):
        if k in r0:
            out[k] = r0[k]
    return out
