"""`bench tp`: FSDP x tensor parallel on a (dp=2, tp=2) mesh of 4 gloo ranks: a training step of the bench20m GPT
whose MLPs torch's ``parallelize_module`` splits (fc column-wise, proj row-wise; the fused-qkv attention stays
unsplit), with torch's AdamW, our ``fully_shard`` over the dp dim against torch's ``fully_shard`` over it, in the
same ``run_on_ranks`` call.

Both models come from the same seed and see the same batches (each dp rank its rows; the TP ranks of a dp rank the
same). Step k runs ours then FSDP2 for even k, FSDP2 then ours for odd k. Step 0 is a warmup, step 1 is counted
(``count_collectives``: FSDP's gathers and reduce-scatters and TP's own collectives, on both sides alike) and the
rest are timed (medians). Rank 0 then replays every step in one process on the unsplit model (each dp rank's rows
as a micro-batch, so the gradient sum has the same terms) and compares each side's full params with it.

Then, in a second ``run_on_ranks`` call on the same mesh (``muon=False`` skips it), the Muon part
(``ragged_optim.bench.tp_muon``): ``ro.Muon`` against ``torch.optim.Muon`` on the same torch FSDP2 + TP DTensor
matrices (every block's qkv, attention proj, fc and proj split by torch's TP plan): ``muon_*`` and
``owner_compute_*`` keys.
"""

from __future__ import annotations

import torch

from ragged_optim.bench.common import alternate_sides, median, single_replay
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.data import get_batch
from ragged_optim.models import build_model, get_config, num_params

DESCRIPTION = "FSDP x TP (mesh 2x2): GPT bench20m training step, ours vs torch FSDP2 + TP (time, bytes, parity)"


def _mlp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}


def _shard(model, kind: str, mesh):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from ragged_optim.sharding import fully_shard

    shard = fully_shard if kind == "ours" else torch_fully_shard
    for block in model.layers:
        parallelize_module(block, mesh["tp"], _mlp_plan())
        shard(block, mesh=mesh["dp"])
    shard(model, mesh=mesh["dp"])
    return model


def _adamw(model, lr):
    # (per param: torch's foreach kernels refuse one list of DTensors on two meshes, TP's (dp, tp) and the plain
    # params' dp, on FSDP2 as on ours)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=False)


def _rank(rank, world_size, cfg, dp, tp, batch_size, steps, lr, compare_single):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()

    def batch(s, r):
        return get_batch("train", batch_size, cfg.seq_len, s, r, dp)

    sides = {}
    for kind in ("ours", "fsdp2"):
        model = _shard(build_model(cfg, seed=0), "ours" if kind == "ours" else "torch", mesh)
        sides[kind] = (model, _adamw(model, lr))
    out = alternate_sides(sides, [batch(s, dp_rank) for s in range(steps + 2)])
    full = {kind: {n: p.full_tensor() for n, p in m.named_parameters()} for kind, (m, _) in sides.items()}
    if rank == 0 and compare_single:
        ref = build_model(cfg, seed=0)
        single = single_replay(ref, _adamw(ref, lr), steps + 2, dp, batch)
        with torch.no_grad():
            for kind, key in (
                ("ours", "param_max_abs_diff_vs_single"),
                ("fsdp2", "fsdp2_param_max_abs_diff_vs_single"),
            ):
                out[key] = max((full[kind][n] - single[n]).abs().max().item() for n in single)
    return out


def run(
    world_size: int = 4,
    steps: int | None = None,
    *,
    tp: int = 2,
    preset: str = "bench20m",
    batch_size: int | None = None,
    seq_len: int | None = 128,
    lr: float = 1e-3,
    compare_single: bool = True,
    timeout_s: float = 600.0,
    muon: bool = True,
    muon_steps: int | None = None,
) -> dict:
    """Run on ``world_size`` gloo ranks as a (world_size // tp, tp) mesh; ``steps`` timed steps (default 4) after
    a warmup and a counted step; ``batch_size``: the global batch (default one row per dp rank). ``muon``: also run
    the Muon part (``muon_steps`` timed optimizer steps, default 2)."""
    steps = 4 if steps is None else steps
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if tp < 1 or world_size % tp:
        raise ValueError(f"tp={tp} must divide world_size={world_size} (the mesh is (world_size // tp, tp))")
    dp = world_size // tp
    cfg = get_config(preset, **({"seq_len": seq_len} if seq_len is not None else {}))
    if (cfg.mlp_ratio * cfg.d_model) % tp or cfg.d_model % tp:
        raise ValueError(f"tp={tp} must divide the MLP's widths ({cfg.d_model}, {cfg.mlp_ratio * cfg.d_model})")
    batch_size = batch_size or dp
    results = run_on_ranks(_rank, world_size, cfg, dp, tp, batch_size, steps, lr, compare_single, timeout_s=timeout_s)
    out = {
        "world_size": world_size,
        "mesh": {"dp": dp, "tp": tp},
        "preset": preset,
        "params": num_params(build_model(cfg, device="meta")),
        "tp_plan": "per block: mlp.fc ColwiseParallel, mlp.proj RowwiseParallel (attention and norms unsplit)",
        "global_batch": batch_size,
        "seq_len": cfg.seq_len,
        "timed_steps": steps,
        "harness": "one run_on_ranks call: both models per rank, ours and fsdp2 alternating each step",
    }
    out.update(results[0])
    out["step_time_ratio"] = out["ours_step_s"] / out["fsdp2_step_s"]
    out["step_time_ratio_paired_median"] = median(
        [a / b for a, b in zip(out["ours_step_times_s"], out["fsdp2_step_times_s"])]
    )
    out["adamw_step_time_ratio"] = out["ours_adamw_step_s"] / out["fsdp2_adamw_step_s"]
    fsdp2_bytes = out["fsdp2_bytes_per_step"]
    out["bytes_ratio"] = out["ours_bytes_per_step"] / fsdp2_bytes if fsdp2_bytes else None
    out["ranks_agree_on_counts"] = all(
        r["ours_comm"] == results[0]["ours_comm"] and r["fsdp2_comm"] == results[0]["fsdp2_comm"] for r in results
    )
    if muon:
        from ragged_optim.bench.tp_muon import muon_part

        out.update(muon_part(world_size, muon_steps, tp=tp, preset=preset, compare_single=compare_single))
    return out
