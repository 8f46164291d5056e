"""`bench fsdp`: one training step of a ~20M-param GPT with torch.optim.AdamW, our RaggedShard ``fully_shard``
against PyTorch FSDP2's ``fully_shard``, in the same ``run_on_ranks`` call.

Both models come from the same seed and see the same per-rank batches. Step k runs ours then FSDP2 for even k,
FSDP2 then ours for odd k, so drifting machine load hits both alike. Step 0 is a warmup, step 1 is counted
(``count_collectives`` around forward + backward + ``opt.step()``) and the rest are timed (barrier on each
side; the reported time is the median). Afterwards rank 0 replays every step in one process (each rank's rows as a
micro-batch, so the gradient sum has the same terms) and compares our full params with it. The same is then done
with activation checkpointing on both sides (every block recomputed in backward, ``use_reentrant=False``): keys
ending in ``_ac``; recomputing changes no value, so the one-process replay serves both.
"""

from __future__ import annotations

import torch

from ragged_optim.bench.common import alternate_sides, median, rank_device, single_replay
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.data import get_batch
from ragged_optim.models import build_model, get_config, num_params
from ragged_optim.sharding import full_tensor
from ragged_optim.train import shard_model

DESCRIPTION = "GPT (bench20m) + AdamW step: ours vs torch FSDP2 (time, collectives, bytes, parity)"


def _adamw(model, lr):
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)


def _measure(rank, world_size, cfg, batches, lr, ac, device="cpu"):
    """Train ours and FSDP2 side by side on ``batches``; their times, counts and final full params."""
    ours = shard_model(build_model(cfg, seed=0).to(device), "ours")
    fsdp2 = shard_model(build_model(cfg, seed=0).to(device), "torch")
    ours.activation_checkpointing = fsdp2.activation_checkpointing = ac
    sides = {"ours": (ours, _adamw(ours, lr)), "fsdp2": (fsdp2, _adamw(fsdp2, lr))}
    figures = alternate_sides(sides, batches)
    full = {
        "ours": {n: full_tensor(p).clone() for n, p in ours.named_parameters()},
        "fsdp2": {n: p.full_tensor().clone() for n, p in fsdp2.named_parameters()},
    }
    return figures, full


def _rank(rank, world_size, cfg, batch_size, steps, lr, compare_single):
    device = rank_device()

    def batch(s, r):
        return tuple(t.to(device) for t in get_batch("train", batch_size, cfg.seq_len, s, r, world_size))

    batches = [batch(s, rank) for s in range(steps + 2)]
    out, full = _measure(rank, world_size, cfg, batches, lr, False, device)
    with_ac, full_ac = _measure(rank, world_size, cfg, batches, lr, True, device)
    for key in ("ours_step_s", "fsdp2_step_s", "ours_step_times_s", "fsdp2_step_times_s"):
        out[f"{key}_ac"] = with_ac[key]
    if rank != 0:
        return out
    if compare_single:
        ref = build_model(cfg, seed=0).to(device)
        single = single_replay(ref, _adamw(ref, lr), steps + 2, world_size, batch)
        with torch.no_grad():

            def diff(params):
                return max((params[n] - single[n]).abs().max().item() for n in single)

            out["param_max_abs_diff_vs_single"] = diff(full["ours"])
            out["fsdp2_param_max_abs_diff_vs_single"] = diff(full["fsdp2"])
            out["param_max_abs_diff_vs_single_ac"] = diff(full_ac["ours"])
            out["fsdp2_param_max_abs_diff_vs_single_ac"] = diff(full_ac["fsdp2"])
    return out


def run(
    world_size: int = 4,
    steps: int | None = None,
    *,
    preset: str = "bench20m",
    batch_size: int | None = None,
    seq_len: int | None = 128,
    lr: float = 1e-3,
    compare_single: bool = True,
    timeout_s: float = 600.0,
    device: str = "cpu",
    **overrides,
) -> dict:
    """Run the benchmark on ``world_size`` gloo ranks; ``steps`` timed steps (default 4) after a warmup and a
    counted step. ``preset``/``seq_len``/``overrides``: the GPT (``ragged_optim.models`` preset fields; seq_len
    128 instead of bench20m's 256 keeps a run near a minute on 2 cores, with 19.7M params); ``batch_size``: the
    global batch (default 1 row per rank)."""
    steps = 4 if steps is None else steps
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if seq_len is not None:
        overrides["seq_len"] = seq_len
    cfg = get_config(preset, **overrides)
    batch_size = batch_size or world_size
    results = run_on_ranks(
        _rank, world_size, cfg, batch_size, steps, lr, compare_single, timeout_s=timeout_s, device=device
    )
    out = {
        "world_size": world_size,
        "preset": preset,
        "params": num_params(build_model(cfg, device="meta")),
        "global_batch": batch_size,
        "seq_len": cfg.seq_len,
        "timed_steps": steps,
        "device": device,
        "harness": "one run_on_ranks call: both models per rank, ours and fsdp2 alternating each step",
    }
    out.update(results[0])
    out["step_time_ratio"] = out["ours_step_s"] / out["fsdp2_step_s"]
    # our params are DTensors (RaggedShard), so torch's AdamW above steps DTensors on both sides: the name
    out["step_time_ratio_torch_adamw_dtensor"] = out["step_time_ratio"]
    out["adamw_step_time_ratio"] = out["ours_adamw_step_s"] / out["fsdp2_adamw_step_s"]
    out["step_time_ratio_ac"] = out["ours_step_s_ac"] / out["fsdp2_step_s_ac"]
    pairs = [a / b for a, b in zip(out["ours_step_times_s"], out["fsdp2_step_times_s"])]
    out["step_time_ratio_paired_median"] = median(pairs)
    # FSDP2 skips its collectives at world size 1 (a local copy); a ratio to 0 bytes would mean nothing.
    fsdp2_bytes = out["fsdp2_bytes_per_step"]
    out["bytes_ratio"] = out["ours_bytes_per_step"] / fsdp2_bytes if fsdp2_bytes else None
    out["ranks_agree_on_counts"] = all(
        r["ours_comm"] == results[0]["ours_comm"] and r["fsdp2_comm"] == results[0]["fsdp2_comm"] for r in results
    )
    return out
