"""AdamW8bit benchmark: state bytes, loss vs fp32 AdamW, sharded == unsharded, and torchao's AdamW8bit on FSDP2.

``run(world_size=3, steps=...)`` trains the small GPT (``ragged_optim.models``, preset ``tiny`` by default) on
``world_size`` gloo ranks with ``ragged_optim.fully_shard`` and :class:`ragged_optim.optim.adamw8bit.AdamW8bit`,
and compares it with

- fp32 ``torch.optim.AdamW`` (one process, same global batches, same hyperparameters): ``loss_ratio_vs_fp32`` is
  the ratio of the validation losses after the same number of steps, the mean over ``seeds`` seeds (init and
  batches) with the seed-to-seed spread beside it (``loss_ratio_vs_fp32_seed_std``, ``loss_ratio_vs_fp32_seeds``).
  Seed 0 is the sharded run; further seeds train AdamW8bit in one process (the optimizer's sharded step equals the
  one-process step bit for bit: ``max_abs_diff_sharded_vs_unsharded``);
- a one-process AdamW8bit replay fed the sharded run's full gradients step by step: ``max_abs_diff_sharded_vs_
  unsharded`` is the largest difference of any param after the run (0.0 means bit-identical);
- torchao's ``AdamW8bit`` on torch FSDP2 (when importable): ``opt_step_s_ratio_vs_torchao`` is our median
  ``opt.step()`` time over theirs (below 1: ours is faster), measured after two warm-up steps (torch.compile).

``qmap_sweep(steps=...)`` trains one process with each pair of quantization formats for the two moments and
reports the loss ratio against fp32 AdamW; docs/adamw8bit.md explains the default choice with its figures.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from ragged_optim.bench.common import seed_stats

BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.01
LR = 3e-3
EVAL_BATCHES = 4


def _lr_mult(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _make_opt(kind: str, params, lr: float, qmaps=None) -> torch.optim.Optimizer:
    if kind == "fp32":
        return torch.optim.AdamW(params, lr=lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, foreach=False)
    if kind == "ours":
        from ragged_optim.optim.adamw8bit import DEFAULT_QMAPS, AdamW8bit

        return AdamW8bit(params, lr=lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, qmaps=qmaps or DEFAULT_QMAPS)
    if kind == "torchao":
        from torchao.optim import AdamW8bit as TorchaoAdamW8bit

        return TorchaoAdamW8bit(params, lr=lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    raise ValueError(f"unknown optimizer kind {kind!r}")


def _state_bytes(opt: torch.optim.Optimizer) -> tuple[int, int]:
    """(bytes, elements) of the 8-bit state of our optimizer on this rank (codes + scales)."""
    if hasattr(opt, "state_bytes"):
        b = opt.state_bytes()
        return b["8bit"], b["8bit_numel"]
    return 0, 0


def _train(
    rank: int,
    world_size: int,
    *,
    kind: str,
    fsdp: str,
    steps: int,
    preset: str,
    batch_size: int,
    lr: float,
    seed: int,
    qmaps=None,
    record_grads: bool = False,
) -> dict[str, Any] | None:
    """Train on this rank; rank 0 returns losses, final full params, step times, state bytes (and grads)."""
    from ragged_optim.data import get_batch
    from ragged_optim.models import build_model
    from ragged_optim.sharding import full_tensor
    from ragged_optim.sharding.sharded_param import full_grad

    distributed = dist.is_available() and dist.is_initialized()
    torch.manual_seed(seed)
    model = build_model(preset, seed=seed)
    seq_len = model.config.seq_len
    if fsdp == "ours":
        from ragged_optim.sharding import fully_shard
    elif fsdp == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = None
    if fully_shard is not None:
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
    opt = _make_opt(kind, model.parameters(), lr, qmaps)
    names = [n for n, _ in model.named_parameters()]
    warmup = max(1, min(20, steps // 10))
    losses, step_s, grads = [], [], []
    for step in range(steps):
        _set_lr(opt, lr * _lr_mult(step, steps, warmup))
        x, y = get_batch("train", batch_size, seq_len, step, rank, world_size, seed)
        loss = model(x, y)
        loss.backward()
        if record_grads:
            grads.append({n: full_grad(p) for n, p in model.named_parameters()})
        if distributed:
            dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        if distributed:
            dist.barrier()
        step_s.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
        losses.append(_mean(loss.detach(), distributed))
    with torch.no_grad():
        val = sum(
            model(*get_batch("val", batch_size, seq_len, i, rank, world_size, seed)).detach()
            for i in range(EVAL_BATCHES)
        )
    val_loss = _mean(val / EVAL_BATCHES, distributed)
    params = {n: full_tensor(p).clone() for n, p in model.named_parameters()}
    nbytes, numel = _state_bytes(opt)
    if distributed:
        t = torch.tensor([nbytes, numel], dtype=torch.float64)
        dist.all_reduce(t)
        nbytes, numel = int(t[0]), int(t[1])
    if rank != 0:
        return None
    return {
        "losses": losses,
        "val_loss": val_loss,
        "params": params,
        "names": names,
        "step_s": step_s,
        "state_bytes": nbytes,
        "state_numel": numel,
        "grads": grads,
    }


def _set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(lr)  # torchao keeps lr as a tensor (no recompile when it changes)
        else:
            g["lr"] = lr


def _mean(x: torch.Tensor, distributed: bool) -> float:
    x = x.detach().clone().float()
    if distributed:
        dist.all_reduce(x)
        x /= dist.get_world_size()
    return float(x.item())


def _replay(grads: list[dict], *, steps: int, preset: str, lr: float, seed: int) -> dict[str, torch.Tensor]:
    """One process, plain tensors: AdamW8bit fed the recorded full gradients, the same lr schedule."""
    from ragged_optim.models import build_model

    model = build_model(preset, seed=seed)
    opt = _make_opt("ours", model.parameters(), lr)
    warmup = max(1, min(20, steps // 10))
    named = dict(model.named_parameters())
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * _lr_mult(step, steps, warmup)
        for n, p in named.items():
            p.grad = grads[step][n]
        opt.step()
    return {n: p.detach().clone() for n, p in named.items()}


def _one_process(**kw) -> dict[str, Any]:
    """``_train`` on this process without a process group (world size 1)."""
    return _train(0, 1, **kw)  # type: ignore[return-value]


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.match(r"^\w+(Error|Exception): ", ln)]
    msg = errs[-1] if errs else (lines[0] if lines else "")
    return f"{type(e).__name__}: {msg}"[:300]


def run(
    world_size: int = 3,
    steps: int = 100,
    *,
    preset: str = "tiny",
    batch_size: int | None = None,
    lr: float = LR,
    seed: int = 0,
    torchao: bool = True,
    torchao_steps: int = 8,
    torchao_timeout_s: float = 240.0,
    seeds: int = 3,
) -> dict[str, Any]:
    """The AdamW8bit benchmark (see the module docstring). Keys: ``state_bytes_per_param``,
    ``fp32_adamw_state_bytes_per_param``, ``loss_ratio_vs_fp32``, ``max_abs_diff_sharded_vs_unsharded``,
    ``torchao_status``, ``opt_step_s_ratio_vs_torchao`` and supporting figures."""
    from ragged_optim.comm.launch import run_on_ranks

    if batch_size is None:
        batch_size = 4 * world_size
    common = dict(steps=steps, preset=preset, batch_size=batch_size, lr=lr, seed=seed)
    t0 = time.perf_counter()
    ours = run_on_ranks(_train, world_size, kind="ours", fsdp="ours", record_grads=True, **common)[0]
    t_ours = time.perf_counter() - t0
    fp32 = _one_process(kind="fp32", fsdp="none", **common)
    replay = _replay(ours["grads"], steps=steps, preset=preset, lr=lr, seed=seed)
    diff = max((ours["params"][n] - replay[n]).abs().max().item() for n in replay)
    ratios = [ours["val_loss"] / fp32["val_loss"]]
    for extra in range(seed + 1, seed + seeds):
        kw = dict(common, seed=extra)
        ratios.append(
            _one_process(kind="ours", fsdp="none", **kw)["val_loss"]
            / _one_process(kind="fp32", fsdp="none", **kw)["val_loss"]
        )
    ratio = seed_stats(ratios)
    result: dict[str, Any] = {
        "world_size": world_size,
        "steps": steps,
        "preset": preset,
        "global_batch_size": batch_size,
        "n_params": sum(p.numel() for p in replay.values()),
        "n_params_8bit": ours["state_numel"],
        "state_bytes_per_param": ours["state_bytes"] / max(1, ours["state_numel"]),
        "fp32_adamw_state_bytes_per_param": 8.0,
        "val_loss": ours["val_loss"],
        "fp32_val_loss": fp32["val_loss"],
        "loss_ratio_vs_fp32": ratio["mean"],
        "loss_ratio_vs_fp32_seed_std": ratio["seed_std"],
        "loss_ratio_vs_fp32_seeds": ratio,
        "train_loss_last10": statistics.fmean(ours["losses"][-10:]),
        "fp32_train_loss_last10": statistics.fmean(fp32["losses"][-10:]),
        "max_abs_diff_sharded_vs_unsharded": diff,
        "opt_step_s_median": statistics.median(ours["step_s"][2:] or ours["step_s"]),
        "ours_run_s": t_ours,
        "torchao_status": "not run",
        "opt_step_s_ratio_vs_torchao": None,
    }
    if torchao:
        try:
            import torchao as _  # noqa: F401

            # Timing only (its loss is reported, not compared): a few steps after torch.compile's warm-up.
            tao_kw = dict(common, steps=min(steps, torchao_steps))
            tao = run_on_ranks(_train, world_size, kind="torchao", fsdp="torch", timeout_s=torchao_timeout_s, **tao_kw)
            tao = tao[0]
            result["torchao_status"] = "ok"
            tao_step = statistics.median(tao["step_s"][2:] or tao["step_s"])
            result["torchao_opt_step_s_median"] = tao_step
            result["torchao_val_loss"] = tao["val_loss"]
            result["opt_step_s_ratio_vs_torchao"] = result["opt_step_s_median"] / tao_step
        except Exception as e:  # ImportError, a failing rank, a timeout: reported, never raised
            result["torchao_status"] = _one_line(e)
    return result


#: Format pairs compared by :func:`qmap_sweep`: (first moment m, second moment v).
SWEEP_QMAPS = (
    ("dynamic", "dynamic_unsigned"),
    ("dynamic", "dynamic"),
    ("int8", "dynamic_unsigned"),
    ("dynamic", "int8"),
    ("int8", "int8"),
    ("fp8_e4m3", "fp8_e4m3"),
)


def qmap_sweep(
    steps: int = 300, *, preset: str = "tiny", batch_size: int = 16, lr: float = LR, seed: int = 0, qmaps=SWEEP_QMAPS
) -> dict[str, Any]:
    """One process, ``steps`` steps per run: validation loss of AdamW8bit with each (m, v) format pair, over the
    fp32 AdamW run's (``loss_ratio``; also the mean train loss of the last 20 steps)."""
    common = dict(fsdp="none", steps=steps, preset=preset, batch_size=batch_size, lr=lr, seed=seed)
    fp32 = _one_process(kind="fp32", **common)
    out: dict[str, Any] = {
        "steps": steps,
        "fp32": {"val_loss": fp32["val_loss"], "train_last20": statistics.fmean(fp32["losses"][-20:])},
    }
    for qm in qmaps:
        r = _one_process(kind="ours", qmaps=qm, **common)
        out[f"{qm[0]}/{qm[1]}"] = {
            "val_loss": r["val_loss"],
            "loss_ratio": r["val_loss"] / fp32["val_loss"],
            "train_last20": statistics.fmean(r["losses"][-20:]),
        }
    return out


if __name__ == "__main__":  # pragma: no cover - manual runs
    import json
    import sys

    what = sys.argv[1] if len(sys.argv) > 1 else "run"
    res = qmap_sweep() if what == "sweep" else run()
    print(json.dumps(res, indent=1))
