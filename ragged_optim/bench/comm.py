"""`bench comm`: quantized communication against full precision, in the same run on the same model and data.

Three configs train the small GPT with AdamW on our ``fully_shard``: fp32 collectives; bf16 (params all-gathered
and grads reduced in bf16, fp32 master params); int8 (block-wise int8 parameter all-gather and the qgZ int8
gradient all-to-all with an fp32 sum). Bytes are this rank's collective message sizes per training step.

bf16 here is a ``MixedPrecisionPolicy``: forward and backward compute in bf16 too, so on a CPU without a bf16 GEMM
``step_time_ratio_bf16_vs_fp32`` measures torch's generic bf16 matmul loop (7.5x in one run), not the wire. The int8
config keeps fp32 compute, so its time ratio is the quantize/dequantize cost against the bytes saved.
"""

from __future__ import annotations

import torch

from ragged_optim.bench.common import seed_stats
from ragged_optim.bench.training import final_loss, train_config
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.models import get_config
from ragged_optim.train import shard_model

DESCRIPTION = "int8 / bf16 collectives vs fp32 on the small GPT: bytes, step time, loss"


def _policies():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ragged_optim.sharding import CommPolicy

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    return {
        "fp32": {},
        "bf16": {"mp_policy": bf16},
        "int8": {"comm_policy": CommPolicy(param_all_gather="int8", grad_reduce="int8", block_size=128)},
    }


def _grad_reduce_error(rank, world_size, cfg, batch_size) -> float:
    """Relative L2 error of the int8 (qgZ) gradient reduce-scatter against the fp32 one, on real gradients: one
    backward with sync off leaves each unit's flat grads in place; both reductions run on the same buffers."""
    import torch.distributed as dist

    from ragged_optim.comm.collectives import reduce_scatter_flat
    from ragged_optim.comm.quantized import quantized_reduce_scatter
    from ragged_optim.data import get_batch
    from ragged_optim.models import build_model
    from ragged_optim.sharding import units_of

    model = build_model(cfg, seed=0)
    shard_model(model, "ours")
    model.set_requires_gradient_sync(False)
    x, y = get_batch("train", batch_size, cfg.seq_len, 0, rank, world_size, 0)
    model(x, y).backward()
    sq = torch.zeros(2, dtype=torch.float64)  # [sum (int8 - fp32)^2, sum fp32^2]
    for unit in units_of(model):
        full, n = unit.grad_buf, unit.layout.shard_size
        exact, approx = torch.empty(n), torch.empty(n)
        reduce_scatter_flat(exact, full.clone(), group=unit.group)
        quantized_reduce_scatter(approx, full, "int8", 128, group=unit.group)
        sq += torch.stack([(approx - exact).double().square().sum(), exact.double().square().sum()])
    dist.all_reduce(sq)
    return float((sq[0] / sq[1]).sqrt())


def _rank(rank, world_size, cfg, steps, batch_size, lr, seeds):
    out = {"int8_grad_reduce_rel_error": _grad_reduce_error(rank, world_size, cfg, batch_size)}
    for seed in range(seeds):
        for name, kw in _policies().items():
            shard = lambda m, kw=kw: shard_model(m, "ours", **kw)  # noqa: E731
            res = train_config(rank, world_size, cfg, steps, batch_size, lr, shard, seed=seed)
            res.pop("params")
            out.setdefault(name, []).append(res)
    return out


def run(
    world_size: int = 4,
    steps: int | None = None,
    *,
    preset: str = "small",
    batch_size: int = 24,
    lr=3e-3,
    seeds: int = 3,
):
    """``steps`` (default 60) AdamW steps per config and seed (init and batches), ``seeds`` seeds, on
    ``world_size`` gloo ranks. A loss ratio is the mean over seeds of each seed's ratio, with the seed-to-seed
    spread beside it (``..._seed_std``, ``..._seeds``): with one seed it read 0.999 in one run and 1.018 in another.
    Bytes and step times are seed 0's (bytes do not depend on the seed)."""
    steps = 60 if steps is None else steps
    cfg = get_config(preset)
    r = run_on_ranks(_rank, world_size, cfg, steps, batch_size, lr, seeds, timeout_s=1800 * seeds)[0]
    ratio = {
        name: seed_stats([final_loss(q["losses"]) / final_loss(f["losses"]) for q, f in zip(r[name], r["fp32"])])
        for name in ("int8", "bf16")
    }
    fp32, bf16, int8 = r["fp32"][0], r["bf16"][0], r["int8"][0]
    return {
        "world_size": world_size,
        "preset": preset,
        "steps": steps,
        "seeds": seeds,
        "fp32_bytes_per_step": fp32["bytes_per_step"],
        "bf16_bytes_per_step": bf16["bytes_per_step"],
        "int8_bytes_per_step": int8["bytes_per_step"],
        "bytes_ratio_int8_vs_fp32": int8["bytes_per_step"] / fp32["bytes_per_step"],
        "bytes_ratio_bf16_vs_fp32": bf16["bytes_per_step"] / fp32["bytes_per_step"],
        "step_time_ratio_int8_vs_fp32": int8["step_s"] / fp32["step_s"],
        "step_time_ratio_bf16_vs_fp32": bf16["step_s"] / fp32["step_s"],
        "fp32_final_loss_seeds": seed_stats([final_loss(f["losses"]) for f in r["fp32"]]),
        "int8_final_loss_seeds": seed_stats([final_loss(q["losses"]) for q in r["int8"]]),
        "loss_ratio_int8_vs_fp32": ratio["int8"]["mean"],
        "loss_ratio_int8_vs_fp32_seed_std": ratio["int8"]["seed_std"],
        "loss_ratio_int8_vs_fp32_seeds": ratio["int8"],
        "loss_ratio_bf16_vs_fp32": ratio["bf16"]["mean"],
        "loss_ratio_bf16_vs_fp32_seed_std": ratio["bf16"]["seed_std"],
        "loss_ratio_bf16_vs_fp32_seeds": ratio["bf16"],
        "int8_grad_reduce_rel_error": r["int8_grad_reduce_rel_error"],
        "int8_comm_bytes_per_step": int8["comm"],
        "fp32_comm_bytes_per_step": fp32["comm"],
    }
