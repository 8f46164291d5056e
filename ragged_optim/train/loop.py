"""`ragged-optim train`: train the small GPT on byte-level stdlib source with FSDP and a chosen optimizer.

Launch: under torchrun (RANK and WORLD_SIZE set) each process is one rank (NCCL on CUDA, else gloo); otherwise
``--world-size`` gloo ranks are forked on this machine's CPUs. ``--fsdp none`` trains one plain process: the
reference that sharded runs must match (same seed, same global batches, same losses).

Each run writes to a folder of its own, ``runs/<optimizer>-w<W>-<timestamp>/`` (or ``--out DIR``), printed at the
start. Rank 0 shows its progress on stderr (a bar with the ETA on a terminal; in a log, a plain line at each tenth
of the run; ``--no-progress``: none), computes the validation loss every ``--eval-every`` steps (default:
``steps // 8``, at least 8 points whatever ``--steps`` is) and after the last one, and at the end prints a
summary and writes ``<out>/summary.json`` and ``<out>/loss.png`` (train and validation curves). A resumed run
(``--resume``) reports the step it resumed from and the loss there.

Communication in the summary, per step and rank: ``comm_bytes_per_step`` is the collectives' buffer size, the
message size as nccl-tests counts it (all-gather outputs, reduce-scatter, all-to-all and all-reduce inputs);
``comm_sent_bytes_per_step_ring`` and ``comm_received_bytes_per_step_ring`` are what a rank sends and receives
under ring algorithms ((W-1)/W of each buffer, 2 (W-1)/W for an all-reduce; 0 on one rank): estimates, since
the backend picks its own algorithms.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from ragged_optim.comm.counter import CommStats, count_collectives
from ragged_optim.data import get_batch, load_corpus
from ragged_optim.models import GPT, build_model, get_config, num_params
from ragged_optim.train.accounting import optimizer_state_bytes, param_bytes, ring_wire_bytes
from ragged_optim.train.checkpointing import Checkpointer, latest_checkpoint
from ragged_optim.train.config import ConfigError, TrainConfig, lr_multiplier, run_folder
from ragged_optim.train.loss_plot import write_loss_png
from ragged_optim.train.optimizers import OPTIMIZERS, make_optimizer
from ragged_optim.train.progress import Progress


def shard_model(model: GPT, kind: str, **kwargs) -> GPT:
    """FSDP per block of ``model.layers``, then the root: ``"ours"`` (RaggedShard), ``"torch"`` (FSDP2) or
    ``"none"``; ``kwargs`` go to every ``fully_shard`` call (mesh, policies). Returns ``model``."""
    if kind == "none":
        return model
    if kind == "ours":
        from ragged_optim.sharding import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _max_over_mean(values) -> float | None:
    """The busiest rank's figure over the mean (1.0: balanced); None when there is nothing."""
    mean = sum(values) / len(values) if values else 0
    return max(values) / mean if mean > 0 else None


def _mean_over_ranks(x: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size > 1:
        dist.all_reduce(x)
        x = x / world_size
    return x


@torch.no_grad()
def _val_loss(model, cfg: TrainConfig, mcfg, rank: int, world_size: int, device) -> float:
    """The validation loss over ``cfg.eval_batches`` fixed batches, averaged over ranks. Every rank must call it:
    each forward of a sharded model is a collective."""
    val = torch.zeros((), device=device)
    for i in range(cfg.eval_batches):
        x, y = get_batch("val", cfg.batch_size, mcfg.seq_len, i, rank, world_size, cfg.seed)
        val += model(x.to(device), y.to(device)).detach()
    return _mean_over_ranks(val / cfg.eval_batches, world_size).item()


def train_rank(rank: int, world_size: int, cfg: TrainConfig, device: str | torch.device = "cpu") -> dict | None:
    """Train on this rank (the default process group is initialised when world_size > 1). Rank 0 returns the
    summary dict and writes ``<out>/summary.json`` and ``<out>/loss.png``; other ranks return None."""
    cfg.validate(world_size)
    device = torch.device(device)
    torch.manual_seed(cfg.seed + rank)
    mcfg = cfg.model_config()
    model = build_model(mcfg, seed=cfg.seed).to(device)
    n_params = num_params(model)
    fsdp = cfg.fsdp
    shard_model(model, fsdp)
    opt = make_optimizer(cfg.optimizer, model, cfg.lr)
    for group in opt.param_groups:
        group.setdefault("initial_lr", group["lr"])
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else min(20, cfg.steps // 10)

    ckpt = (
        Checkpointer(cfg.checkpoint_dir, fsdp, rank, world_size, cfg.keep_checkpoints) if cfg.checkpoint_dir else None
    )
    start, losses, val_points = 0, [], []
    if cfg.resume and ckpt is not None:
        path = latest_checkpoint(cfg.checkpoint_dir)
        if path is None:
            if rank == 0:
                print(f"no complete checkpoint in {cfg.checkpoint_dir}; starting from step 0", file=sys.stderr)
        else:
            meta = ckpt.load(path, model, opt)
            start, losses = meta["step"], list(meta.get("losses", []))
            val_points = [tuple(v) for v in meta.get("val_losses", [])]
            if start > cfg.steps:  # every rank loads the same meta, so all raise: no hang
                raise ConfigError(_past_steps_message(path, start, cfg.steps))
            if rank == 0:
                print(f"resumed from {path} at step {start}", file=sys.stderr, flush=True)

    tokens_per_step = cfg.batch_size * mcfg.seq_len
    progress = Progress(cfg.steps, enabled=cfg.progress and rank == 0, start=start)
    eval_every = cfg.eval_interval()
    counter = CommStats()  # the collectives of forward, backward and the optimizer step, summed over steps
    train_time = 0.0
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        mult = lr_multiplier(step, cfg.steps, warmup)
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * mult
        x, y = get_batch("train", cfg.batch_size, mcfg.seq_len, step, rank, world_size, cfg.seed)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with count_collectives() as stats:
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        counter.add(stats)
        loss_avg = _mean_over_ranks(loss.detach().clone(), world_size).item()
        train_time += time.perf_counter() - t0
        losses.append(loss_avg)
        done = step + 1
        progress.update(done, loss_avg, tokens_per_step * (done - start) / max(train_time, 1e-9))
        if done == cfg.steps:  # before the last evaluation: FSDP keeps the root unit unsharded after a forward
            mem = [param_bytes(model), optimizer_state_bytes(opt)]  # with no backward
        if cfg.eval_batches and ((eval_every and done % eval_every == 0) or done == cfg.steps):
            # before the checkpoint, so that a resumed run's curve has this point too
            val_points.append((done, _val_loss(model, cfg, mcfg, rank, world_size, device)))
        if ckpt is not None and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
            meta = {"losses": losses, "val_losses": val_points, "seed": cfg.seed, **_run_identity(cfg)}
            ckpt.save(done, model, opt, meta)
    progress.close()
    steps_run = cfg.steps - start

    if start == cfg.steps:  # no step run (the API resumed at --steps): measure and evaluate now
        mem = [param_bytes(model), optimizer_state_bytes(opt)]
        if cfg.eval_batches and (not val_points or val_points[-1][0] != cfg.steps):
            val_points.append((cfg.steps, _val_loss(model, cfg, mcfg, rank, world_size, device)))
    val_loss = val_points[-1][1] if cfg.eval_batches and val_points and val_points[-1][0] == cfg.steps else None

    if world_size > 1:
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, mem)
    else:
        gathered = [mem]
    if rank != 0:
        return None

    per_step = max(1, steps_run)
    out = run_folder(cfg, world_size)
    # A resumed run starts from the loss at the checkpoint's step (losses[start - 1]), not step 1 of the first run.
    first = start - 1 if start else 0
    summary = {
        "out": out,
        "optimizer": cfg.optimizer,
        "fsdp": fsdp,
        "fsdp_requested": cfg.fsdp,
        "preset": cfg.preset,
        "n_params": n_params,
        "world_size": world_size,
        "device": str(device),
        "steps": cfg.steps,
        "start_step": start,
        "resumed": start > 0,
        "batch_size": cfg.batch_size,
        "seq_len": mcfg.seq_len,
        "lr": cfg.lr if cfg.lr is not None else OPTIMIZERS[cfg.optimizer].default_lr,
        "seed": cfg.seed,
        "initial_train_loss_step": first + 1 if len(losses) > first else None,
        "initial_train_loss": losses[first] if len(losses) > first else None,
        "final_train_loss": losses[-1] if losses else None,
        "final_train_loss_avg10": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "val_loss": val_loss,
        "val_losses": [list(v) for v in val_points],
        "tokens_per_s": tokens_per_step * steps_run / train_time if train_time > 0 else None,
        "train_time_s": train_time,
        "comm_bytes_per_step": counter.total_bytes / per_step,
        "comm_sent_bytes_per_step_ring": ring_wire_bytes(counter.bytes, world_size) / per_step,
        "comm_received_bytes_per_step_ring": ring_wire_bytes(counter.bytes, world_size) / per_step,
        "collectives_per_step": counter.total_calls / per_step,
        "comm_by_collective": {
            k: {"calls_per_step": counter.calls[k] / per_step, "bytes_per_step": counter.bytes[k] / per_step}
            for k in sorted(counter.calls)
        },
        "param_bytes_per_rank": [g[0] for g in gathered],
        "optimizer_state_bytes_per_rank": [g[1] for g in gathered],
        "optimizer_state_max_over_mean": _max_over_mean([g[1] for g in gathered]),
        "losses": losses,
    }
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    title = (
        f"{cfg.preset} GPT ({n_params / 1e6:.2f}M params), {cfg.optimizer}, "
        f"world size {world_size} (fsdp {fsdp}), batch {cfg.batch_size} x {mcfg.seq_len}"
    )
    write_loss_png(os.path.join(out, "loss.png"), losses, val_points, title, cfg.log_scale, start or None)
    return summary


def _rank_entry(rank: int, world_size: int, cfg: TrainConfig) -> dict | None:
    return train_rank(rank, world_size, cfg, "cpu")


def _past_steps_message(path: str, step: int, steps: int) -> str:
    return (
        f"--steps {steps} is below the step of the checkpoint to resume ({path} is at step {step}); pass --steps "
        f"greater than {step} to train further, or a --checkpoint-dir without checkpoints to start over"
    )


def _run_identity(cfg: TrainConfig) -> dict:
    """What a checkpoint must have been written with to be resumed by ``cfg`` (each an option of the same name)."""
    return {"optimizer": cfg.optimizer, "preset": cfg.preset, "seq_len": cfg.model_config().seq_len, "fsdp": cfg.fsdp}


def _already_done(cfg: TrainConfig, announce: bool) -> bool:
    """With --resume: raise if the latest checkpoint is past --steps; True (nothing to train) if it is at --steps.
    Checked before any rank starts, so a finished run resumed again exits cleanly instead of reporting a run of
    zero steps."""
    if not (cfg.resume and cfg.checkpoint_dir):
        return False
    path = latest_checkpoint(cfg.checkpoint_dir)
    if path is None:
        return False
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        step = int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--resume: cannot read the step of {path}/meta.json ({e}); remove that folder") from e
    for key, value in _run_identity(cfg).items():
        if key in meta and meta[key] != value:  # (checkpoints of older versions record the optimizer only)
            option = "--" + key.replace("_", "-")
            raise ConfigError(
                f"{option} {value} does not match the checkpoint to resume: {path} was written with {option} "
                f"{meta[key]}; pass {option} {meta[key]}, or a --checkpoint-dir without checkpoints to start over"
            )
    if step > cfg.steps:
        raise ConfigError(_past_steps_message(path, step, cfg.steps))
    if step == cfg.steps:
        if announce:
            print(
                f"nothing to train: the checkpoint to resume ({path}) is already at --steps {cfg.steps}; no summary "
                f"written. Pass --steps greater than {step} to train further.",
                file=sys.stderr,
            )
        return True
    return False


def run(cfg: TrainConfig) -> dict | None:
    """Launch training (torchrun ranks, forked gloo ranks, or one plain process) and return rank 0's summary
    (None on other torchrun ranks, and when --resume finds the run already at --steps)."""
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world_size = int(os.environ["WORLD_SIZE"]) if torchrun else cfg.world_size
    cfg.validate(world_size)  # in the parent: bad input is an error here, not a traceback from every rank
    rank0 = not torchrun or os.environ["RANK"] == "0"
    if _already_done(cfg, announce=rank0):
        return None
    # the folder is fixed here, so forked ranks inherit one name; checked again now that it has one
    cfg = dataclasses.replace(cfg, out=run_folder(cfg, world_size))
    cfg.validate(world_size)
    _check_seq_len(cfg)
    if rank0:
        print(f"run folder: {cfg.out}", file=sys.stderr, flush=True)
    if torchrun:
        return _run_torchrun(cfg)
    load_corpus()  # read once here; forked ranks inherit it
    if cfg.fsdp == "none":  # one thread, as each forked rank runs: the reference sharded runs must match bitwise
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return train_rank(0, 1, cfg, "cpu")
        finally:
            torch.set_num_threads(threads)
    from ragged_optim.comm.launch import run_on_ranks

    return run_on_ranks(_rank_entry, world_size, cfg, timeout_s=cfg.timeout_s)[0]


def _check_seq_len(cfg: TrainConfig) -> None:
    """Every sequence is a window of the text (the validation split is the shorter): a longer --seq-len is refused
    here, not after minutes of silence."""
    val = len(load_corpus().val)
    seq_len = cfg.seq_len or get_config(cfg.preset).seq_len
    if seq_len + 1 > val:
        raise ConfigError(
            f"--seq-len {seq_len} is longer than the validation text ({val:,} bytes), of which every sequence is a "
            "window: use a shorter --seq-len (the presets use 64-256)"
        )


def _run_torchrun(cfg: TrainConfig) -> dict | None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    owns_group = not dist.is_initialized()
    if owns_group:
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.timeout_s), **kwargs)
    try:
        return train_rank(rank, world_size, cfg, device)
    finally:
        if owns_group:
            dist.destroy_process_group()


def format_summary(s: dict) -> str:
    """The summary as a few lines of text; a missing or None value (no steps run, no evaluation) is said in words,
    never formatted as a number."""

    def num(key: str, spec: str = ".4f") -> str:
        v = s.get(key)
        return "n/a" if v is None else format(v, spec)

    def mib(b: float) -> str:
        return f"{b / 2**20:.2f} MiB"

    start, steps = s.get("start_step", 0), s.get("steps")
    trained = steps is None or start < steps
    val = "skipped (--eval-batches 0)" if s.get("val_loss") is None else num("val_loss")
    lines = [
        f"trained {s.get('preset')} ({num('n_params', ',')} params) with {s.get('optimizer')}, fsdp {s.get('fsdp')}, "
        f"{s.get('world_size')} rank(s), steps {start + 1}..{steps}"
        + (f" (resumed from the step-{start} checkpoint)" if s.get("resumed") else ""),
        f"  train loss {num('initial_train_loss')} at step {s.get('initial_train_loss_step')}"
        + (" (resumed there)" if s.get("resumed") else "")
        + f" -> {num('final_train_loss')} at step {steps} (last-10 mean {num('final_train_loss_avg10')}), "
        f"val loss {val}",
    ]
    if trained and s.get("tokens_per_s") is not None:
        lines += [
            f"  {num('tokens_per_s', ',.0f')} tokens/s over {num('train_time_s', '.1f')} s",
            f"  per step per rank: {num('collectives_per_step', '.1f')} collectives over "
            f"{mib(s.get('comm_bytes_per_step') or 0)} of buffers (message size: all-gather outputs, "
            "reduce-scatter and all-reduce inputs)",
        ]
        if s.get("comm_sent_bytes_per_step_ring") is not None:
            lines.append(
                f"  on the wire per step per rank: ~{mib(s['comm_sent_bytes_per_step_ring'])} sent and "
                f"~{mib(s.get('comm_received_bytes_per_step_ring') or 0)} received (ring algorithms: (W-1)/W of "
                "each buffer, 2 (W-1)/W of an all-reduce)"
            )
    else:
        lines.append("  no training steps run" + (f" (resumed at step {start})" if start else ""))
    params, state = s.get("param_bytes_per_rank"), s.get("optimizer_state_bytes_per_rank")
    if params and state:
        per_rank = f"params {', '.join(mib(b) for b in params)}; optimizer state {', '.join(mib(b) for b in state)}"
        balance = _max_over_mean(state)
        lines.append(f"  per rank: {per_rank}" + (f" (max/mean {balance:.2f})" if len(state) > 1 and balance else ""))
    return "\n".join(lines)
