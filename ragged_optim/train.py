"""`ragged-optim train`: train the small GPT on byte-level stdlib source with FSDP and a chosen optimizer.

Launch: under torchrun (RANK and WORLD_SIZE set) each process is one rank (NCCL on CUDA, else gloo); otherwise
``--world-size`` gloo ranks are forked on this machine's CPUs. ``--fsdp none`` trains one plain process: the
reference that sharded runs must match (same seed, same global batches, same losses).

Rank 0 shows a one-line progress bar on stderr and, at the end, prints a summary and writes ``<out>/summary.json``
and ``<out>/loss.png``.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import os
import re
import shutil
import struct
import sys
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ragged_optim.data import get_batch, load_corpus
from ragged_optim.models import GPT, build_model, get_config, num_params

# ---------------------------------------------------------------------------------------------------------------
# Optimizers: the one place that maps a name to a constructor.
# ---------------------------------------------------------------------------------------------------------------

# The optimizer `ragged-optim train` uses when --optimizer is not given.
DEFAULT_OPTIMIZER = "muon"


def _lazy(name: str) -> Any:
    """``ragged_optim.optim.<name>``, or a clear error while that optimizer is still being written."""
    try:
        import ragged_optim.optim as optim_pkg
    except ImportError as e:
        raise RuntimeError(
            f"ragged_optim.optim is not available yet (import failed: {e}); use --optimizer adamw"
        ) from e
    try:
        return getattr(optim_pkg, name)
    except AttributeError:
        raise RuntimeError(
            f"ragged_optim.optim.{name} is not available yet; use --optimizer adamw until it lands"
        ) from None


def _adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    # foreach=False: the same per-param arithmetic on DTensor shards and on plain tensors.
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)


def _muon(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    # Hidden matrices get Muon at ``lr``; embeddings, head and 1-D params get AdamW at AdamW's default lr.
    # Newton-Schulz in bf16 on GPUs (torch.optim.Muon's choice); in fp32 on CPUs, where bf16 matmuls are emulated
    # and ~50x slower here.
    groups = _lazy("muon_param_groups")(model)
    ns_dtype = torch.bfloat16 if next(model.parameters()).is_cuda else torch.float32
    return _lazy("Muon")(
        groups, lr=lr, ns_dtype=ns_dtype, adamw_lr=OPTIMIZERS["adamw"].default_lr, adamw_betas=(0.9, 0.95)
    )


def _shampoo(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return _lazy("Shampoo")(model.parameters(), lr=lr)


def _adamw8bit(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return _lazy("AdamW8bit")(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


@dataclass(frozen=True)
class OptimizerEntry:
    build: Callable[[nn.Module, float], torch.optim.Optimizer]
    default_lr: float


OPTIMIZERS: dict[str, OptimizerEntry] = {
    "adamw": OptimizerEntry(_adamw, 4e-3),
    "muon": OptimizerEntry(_muon, 0.02),
    "shampoo": OptimizerEntry(_shampoo, 3e-3),
    "adamw8bit": OptimizerEntry(_adamw8bit, 3e-3),
}


def make_optimizer(name: str, model: nn.Module, lr: float | None = None) -> torch.optim.Optimizer:
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {sorted(OPTIMIZERS)}")
    entry = OPTIMIZERS[name]
    return entry.build(model, entry.default_lr if lr is None else lr)


# ---------------------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------------------

FSDP_KINDS = ("ours", "torch", "none")


@dataclass
class TrainConfig:
    optimizer: str = DEFAULT_OPTIMIZER
    steps: int = 200
    world_size: int = 4
    preset: str = "small"
    batch_size: int = 24  # global: every rank gets batch_size // world_size rows
    seq_len: int | None = None  # None: the preset's
    lr: float | None = None  # None: the optimizer's default in OPTIMIZERS
    warmup_steps: int | None = None  # None: min(20, steps // 10)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    resume: bool = False
    out: str = "runs/train"
    fsdp: str = "ours"
    seed: int = 0
    eval_batches: int = 4
    timeout_s: float = 3600.0
    progress: bool = True
    extra: dict = field(default_factory=dict)

    def validate(self, world_size: int) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose one of {sorted(OPTIMIZERS)}")
        if self.fsdp not in FSDP_KINDS:
            raise ValueError(f"--fsdp must be one of {FSDP_KINDS}, got {self.fsdp!r}")
        if self.fsdp == "none" and world_size != 1:
            raise ValueError("--fsdp none trains a single unsharded process; pass --world-size 1")
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.batch_size % world_size:
            raise ValueError(
                f"--batch-size {self.batch_size} (global) is not divisible by the world size {world_size}; "
                f"use a multiple of {world_size}"
            )
        if self.resume and not self.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir")
        if self.checkpoint_every < 1:
            raise ValueError(f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")

    def model_config(self):
        overrides = {} if self.seq_len is None else {"seq_len": self.seq_len}
        return get_config(self.preset, **overrides)


def lr_multiplier(step: int, steps: int, warmup: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to 10% at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# ---------------------------------------------------------------------------------------------------------------
# Communication counter
# ---------------------------------------------------------------------------------------------------------------

# TODO(lead): switch to the ragged_optim.comm byte/call counters; this local one patches torch.distributed.
# Collective name -> the parameter holding the input tensor whose bytes are counted.
_COUNTED_COLLECTIVES = {
    "all_gather_into_tensor": "input_tensor",
    "reduce_scatter_tensor": "input",
    "all_to_all_single": "input",
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "all_gather_single": "input_tensor",
    "reduce_scatter_single": "input",
}


class CommCounter:
    """Counts calls and input bytes of torch.distributed collectives while installed and ``active``.

    Only the outermost collective of a nested call chain is counted (e.g. ``all_gather_single`` implemented with
    ``all_gather_into_tensor`` counts once). Collectives issued through ``_functional_collectives`` are not seen.
    """

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self.active = False
        self._local = threading.local()
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> CommCounter:
        import torch.distributed.distributed_c10d as c10d

        for name, arg in _COUNTED_COLLECTIVES.items():
            orig = getattr(dist, name, None)
            if orig is None:
                continue
            wrapped = self._wrap(name, arg, orig)
            for mod in (dist, c10d):
                if getattr(mod, name, None) is orig:
                    self._saved.append((mod, name, orig))
                    setattr(mod, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for mod, name, orig in reversed(self._saved):
            setattr(mod, name, orig)
        self._saved.clear()

    def _wrap(self, name: str, arg: str, orig: Callable) -> Callable:
        sig = inspect.signature(orig)

        def counted(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if self.active and depth == 0:
                t = sig.bind_partial(*args, **kwargs).arguments.get(arg)
                self.calls[name] = self.calls.get(name, 0) + 1
                if isinstance(t, torch.Tensor):
                    self.bytes[name] = self.bytes.get(name, 0) + tensor_bytes(t)
            self._local.depth = depth + 1
            try:
                return orig(*args, **kwargs)
            finally:
                self._local.depth = depth

        counted.__wrapped__ = orig
        return counted

    def counting(self) -> _Active:
        return _Active(self)

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


class _Active:
    def __init__(self, counter: CommCounter) -> None:
        self.counter = counter

    def __enter__(self) -> None:
        self.counter.active = True

    def __exit__(self, *exc) -> None:
        self.counter.active = False


# ---------------------------------------------------------------------------------------------------------------
# Memory accounting
# ---------------------------------------------------------------------------------------------------------------


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for ``t``: the local shard of a DTensor, the inner tensors of a wrapper subclass."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if type(t) is not torch.Tensor and not isinstance(t, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def _nested_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return tensor_bytes(obj)
    if isinstance(obj, dict):
        return sum(_nested_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nested_bytes(v) for v in obj)
    return 0


def param_bytes(model: nn.Module) -> int:
    return sum(tensor_bytes(p) for p in model.parameters())


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(_nested_bytes(s) for s in opt.state.values())


# ---------------------------------------------------------------------------------------------------------------
# Sharding
# ---------------------------------------------------------------------------------------------------------------


def _from_sharding(name: str) -> Callable | None:
    """``ragged_optim.sharding.<name>`` if the package exports it as a function (it is being written), else None."""
    try:
        import ragged_optim.sharding as sharding
    except ImportError:
        return None
    fn = getattr(sharding, name, None)
    return fn if callable(fn) and not inspect.ismodule(fn) else None


def shard_model(model: GPT, kind: str, verbose: bool = True) -> str:
    """Apply FSDP per block, then to the root. Returns the kind actually used ('ours', 'torch' or 'none')."""
    if kind == "none":
        return "none"
    fully_shard = None
    if kind == "ours":
        fully_shard = _from_sharding("fully_shard")
        if fully_shard is None:
            if verbose:
                print(
                    "warning: ragged_optim.sharding.fully_shard is not available yet; "
                    "--fsdp ours falls back to torch.distributed.fsdp.fully_shard",
                    file=sys.stderr,
                    flush=True,
                )
            kind = "torch"
    if kind == "torch":
        from torch.distributed.fsdp import fully_shard
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return kind


def _state_dict_fns(kind: str) -> tuple[Callable, Callable]:
    """(get_state_dict, set_state_dict) with torch.distributed.checkpoint.state_dict's call shape."""
    if kind == "ours":
        # TODO(lead): the ragged runtime's state-dict functions (same call shape as torch's) plug in here.
        get_state_dict, set_state_dict = _from_sharding("get_state_dict"), _from_sharding("set_state_dict")
        if get_state_dict is None or set_state_dict is None:
            raise NotImplementedError(
                "checkpointing with --fsdp ours needs ragged_optim.sharding.get_state_dict/set_state_dict, "
                "which are not available yet; use --fsdp torch to checkpoint"
            )
        return get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    return get_state_dict, set_state_dict


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------------------

_CKPT_RE = re.compile(r"^step_(\d{8})$")


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _dist_on():
        dist.barrier()


def latest_checkpoint(ckpt_dir: str) -> str | None:
    """The newest complete checkpoint folder (``step_NNNNNNNN`` with a ``meta.json``), or None."""
    if not os.path.isdir(ckpt_dir):
        return None
    steps = sorted(
        int(m.group(1))
        for m in map(_CKPT_RE.match, os.listdir(ckpt_dir))
        if m and os.path.isfile(os.path.join(ckpt_dir, m.group(0), "meta.json"))
    )
    return os.path.join(ckpt_dir, f"step_{steps[-1]:08d}") if steps else None


class Checkpointer:
    """Model + optimizer via torch.distributed.checkpoint, plus step, loss history and per-rank RNG state.

    A checkpoint is written into ``.tmp-step_N`` and renamed to ``step_N`` once every rank has finished, with
    ``meta.json`` written last: a folder named ``step_N`` holding ``meta.json`` is complete.
    """

    def __init__(self, ckpt_dir: str, kind: str, rank: int, world_size: int, keep: int = 2) -> None:
        self.dir = ckpt_dir
        self.kind = kind
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self.get_state_dict, self.set_state_dict = _state_dict_fns(kind)

    def save(self, step: int, model: nn.Module, opt: torch.optim.Optimizer, meta: dict) -> str:
        import torch.distributed.checkpoint as dcp

        final = os.path.join(self.dir, f"step_{step:08d}")
        tmp = os.path.join(self.dir, f".tmp-step_{step:08d}")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        _barrier()
        model_sd, optim_sd = self.get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, os.path.join(tmp, f"rng_rank{self.rank}.pt"))
        _barrier()
        if self.rank == 0:
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump({**meta, "step": step, "world_size": self.world_size}, f)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        done = sorted(d for d in os.listdir(self.dir) if _CKPT_RE.match(d))
        for d in done[: max(0, len(done) - self.keep)]:
            shutil.rmtree(os.path.join(self.dir, d), ignore_errors=True)

    def load(self, path: str, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
        import torch.distributed.checkpoint as dcp

        model_sd, optim_sd = self.get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        self.set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        rng_path = os.path.join(path, f"rng_rank{self.rank}.pt")
        if meta.get("world_size") == self.world_size and os.path.isfile(rng_path):
            rng = torch.load(rng_path, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        return meta


# ---------------------------------------------------------------------------------------------------------------
# Progress bar
# ---------------------------------------------------------------------------------------------------------------


class Progress:
    """One line on stderr, redrawn with ``\\r``: step, bar, loss, tokens/s."""

    def __init__(self, total: int, enabled: bool = True, stream=None, min_interval_s: float = 0.1) -> None:
        self.total = total
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self._width = 0

    def update(self, step: int, loss: float, tokens_per_s: float, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.min_interval_s and step < self.total:
            return
        self._last = now
        n = 24
        filled = int(n * step / max(1, self.total))
        line = (
            f"step {step:>{len(str(self.total))}}/{self.total} [{'#' * filled}{'.' * (n - filled)}] "
            f"loss {loss:.4f}  {tokens_per_s:,.0f} tok/s"
        )
        pad = " " * max(0, self._width - len(line))
        self._width = len(line)
        self.stream.write("\r" + line + pad)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\n")
            self.stream.flush()


# ---------------------------------------------------------------------------------------------------------------
# Loss plot: matplotlib when installed, else a PNG rasterised here (zlib + struct, no dependency).
# ---------------------------------------------------------------------------------------------------------------


def write_loss_png(path: str, losses: list[float], val_loss: float | None = None, title: str = "") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _write_png(path, _rasterise_curve(losses, val_loss))
        return
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    ax.plot(range(1, len(losses) + 1), losses, lw=1.2, label="train loss")
    if val_loss is not None:
        ax.axhline(val_loss, color="tab:red", ls="--", lw=1, label=f"val loss {val_loss:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# 3x5 bitmap digits, rows top to bottom, 3 bits per row (MSB = left pixel).
_DIGITS = {
    "0": (7, 5, 5, 5, 7),
    "1": (2, 6, 2, 2, 7),
    "2": (7, 1, 7, 4, 7),
    "3": (7, 1, 7, 1, 7),
    "4": (5, 5, 7, 1, 1),
    "5": (7, 4, 7, 1, 7),
    "6": (7, 4, 7, 5, 7),
    "7": (7, 1, 2, 2, 2),
    "8": (7, 5, 7, 5, 7),
    "9": (7, 5, 7, 1, 7),
    ".": (0, 0, 0, 0, 2),
}


def _rasterise_curve(losses: list[float], val_loss: float | None, w: int = 640, h: int = 360) -> list[bytearray]:
    rows = [bytearray(b"\xff" * (3 * w)) for _ in range(h)]

    def put(x: int, y: int, rgb: tuple[int, int, int]) -> None:
        if 0 <= x < w and 0 <= y < h:
            rows[y][3 * x : 3 * x + 3] = bytes(rgb)

    def text(x: int, y: int, s: str, rgb=(60, 60, 60), scale: int = 2) -> None:
        for ch in s:
            for r, bits in enumerate(_DIGITS.get(ch, (0,) * 5)):
                for c in range(3):
                    if bits >> (2 - c) & 1:
                        for dy in range(scale):
                            for dx in range(scale):
                                put(x + c * scale + dx, y + r * scale + dy, rgb)
            x += 4 * scale

    def line(x0: int, y0: int, x1: int, y1: int, rgb, thick: int = 1) -> None:
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for t in range(thick):
                put(x0, y0 + t, rgb)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    left, right, top, bottom = 48, w - 16, 16, h - 32
    finite = [v for v in losses if math.isfinite(v)]
    if val_loss is not None and math.isfinite(val_loss):
        finite.append(val_loss)
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    lo, hi = math.floor(lo), math.ceil(hi)
    if hi <= lo:
        hi = lo + 1
    n = max(2, len(losses))

    def px(i: int) -> int:
        return left + round((right - left) * i / (n - 1))

    def py(v: float) -> int:
        return bottom - round((bottom - top) * (v - lo) / (hi - lo))

    for tick in range(lo, hi + 1):  # horizontal grid + labels at whole nats
        y = py(tick)
        for x in range(left, right + 1, 2):
            put(x, y, (215, 215, 215))
        text(8, y - 5, str(tick))
    line(left, top, left, bottom, (0, 0, 0))
    line(left, bottom, right, bottom, (0, 0, 0))
    text(right - 8 * len(str(len(losses))), bottom + 10, str(len(losses)))
    text(left, bottom + 10, "1")
    if val_loss is not None and math.isfinite(val_loss):
        y = py(val_loss)
        for x in range(left, right, 10):
            line(x, y, min(x + 5, right), y, (214, 39, 40), thick=2)
    pts = [(px(i), py(v)) for i, v in enumerate(losses) if math.isfinite(v)]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        line(x0, y0, x1, y1, (31, 119, 180), thick=2)
    if len(pts) == 1:
        line(pts[0][0], pts[0][1], pts[0][0] + 1, pts[0][1], (31, 119, 180), thick=2)
    return rows


def _write_png(path: str, rows: list[bytearray]) -> None:
    h, w = len(rows), len(rows[0]) // 3

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + bytes(r) for r in rows)  # filter type 0 per scanline
    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))  # 8-bit RGB
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )
    with open(path, "wb") as f:
        f.write(png)


# ---------------------------------------------------------------------------------------------------------------
# The training loop (runs on every rank)
# ---------------------------------------------------------------------------------------------------------------


def _mean_over_ranks(x: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size > 1:
        dist.all_reduce(x)
        x = x / world_size
    return x


def train_rank(rank: int, world_size: int, cfg: TrainConfig, device: str | torch.device = "cpu") -> dict | None:
    """Train on this rank (the default process group is initialised when world_size > 1). Rank 0 returns the
    summary dict and writes ``<out>/summary.json`` and ``<out>/loss.png``; other ranks return None."""
    cfg.validate(world_size)
    device = torch.device(device)
    torch.manual_seed(cfg.seed + rank)
    mcfg = cfg.model_config()
    model = build_model(mcfg, seed=cfg.seed).to(device)
    n_params = num_params(model)
    fsdp = shard_model(model, cfg.fsdp, verbose=rank == 0)
    opt = make_optimizer(cfg.optimizer, model, cfg.lr)
    for group in opt.param_groups:
        group.setdefault("initial_lr", group["lr"])
    if rank == 0 and cfg.optimizer == "muon" and not any(g.get("use_muon") and g["params"] for g in opt.param_groups):
        print(
            f"warning: Muon found no matrix params under --fsdp {fsdp} (the sharded params it sees are not 2-D); "
            "every param runs the AdamW rule",
            file=sys.stderr,
            flush=True,
        )
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else min(20, cfg.steps // 10)

    ckpt = (
        Checkpointer(cfg.checkpoint_dir, fsdp, rank, world_size, cfg.keep_checkpoints) if cfg.checkpoint_dir else None
    )
    start, losses = 0, []
    if cfg.resume and ckpt is not None:
        path = latest_checkpoint(cfg.checkpoint_dir)
        if path is None:
            if rank == 0:
                print(f"no complete checkpoint in {cfg.checkpoint_dir}; starting from step 0", file=sys.stderr)
        else:
            meta = ckpt.load(path, model, opt)
            start, losses = meta["step"], list(meta.get("losses", []))
            if rank == 0:
                print(f"resumed from {path} at step {start}", file=sys.stderr, flush=True)

    tokens_per_step = cfg.batch_size * mcfg.seq_len
    progress = Progress(cfg.steps, enabled=cfg.progress and rank == 0)
    counter = CommCounter()
    train_time = 0.0
    with counter:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            mult = lr_multiplier(step, cfg.steps, warmup)
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * mult
            x, y = get_batch("train", cfg.batch_size, mcfg.seq_len, step, rank, world_size, cfg.seed)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with counter.counting():
                loss = model(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            loss_avg = _mean_over_ranks(loss.detach().clone(), world_size).item()
            train_time += time.perf_counter() - t0
            losses.append(loss_avg)
            done = step + 1
            progress.update(done, loss_avg, tokens_per_step * (done - start) / max(train_time, 1e-9))
            if ckpt is not None and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
                ckpt.save(done, model, opt, {"losses": losses, "seed": cfg.seed, "optimizer": cfg.optimizer})
    progress.close()
    steps_run = cfg.steps - start

    # Measured before evaluation: FSDP keeps the root unit unsharded after a forward with no backward.
    mem = [param_bytes(model), optimizer_state_bytes(opt)]
    with torch.no_grad():
        val = torch.zeros((), device=device)
        for i in range(cfg.eval_batches):
            x, y = get_batch("val", cfg.batch_size, mcfg.seq_len, i, rank, world_size, cfg.seed)
            val += model(x.to(device), y.to(device)).detach()
        val_loss = _mean_over_ranks(val / max(1, cfg.eval_batches), world_size).item() if cfg.eval_batches else None

    if world_size > 1:
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, mem)
    else:
        gathered = [mem]
    if rank != 0:
        return None

    per_step = max(1, steps_run)
    summary = {
        "optimizer": cfg.optimizer,
        "fsdp": fsdp,
        "fsdp_requested": cfg.fsdp,
        "preset": cfg.preset,
        "n_params": n_params,
        "world_size": world_size,
        "device": str(device),
        "steps": cfg.steps,
        "start_step": start,
        "batch_size": cfg.batch_size,
        "seq_len": mcfg.seq_len,
        "lr": cfg.lr if cfg.lr is not None else OPTIMIZERS[cfg.optimizer].default_lr,
        "seed": cfg.seed,
        "initial_train_loss": losses[0] if losses else None,
        "final_train_loss": losses[-1] if losses else None,
        "final_train_loss_avg10": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "val_loss": val_loss,
        "tokens_per_s": tokens_per_step * steps_run / train_time if train_time > 0 else None,
        "train_time_s": train_time,
        "comm_bytes_per_step": counter.total_bytes / per_step,
        "collectives_per_step": counter.total_calls / per_step,
        "comm_by_collective": {
            k: {"calls_per_step": counter.calls[k] / per_step, "bytes_per_step": counter.bytes.get(k, 0) / per_step}
            for k in sorted(counter.calls)
        },
        "param_bytes_per_rank": [g[0] for g in gathered],
        "optimizer_state_bytes_per_rank": [g[1] for g in gathered],
        "losses": losses,
    }
    os.makedirs(cfg.out, exist_ok=True)
    with open(os.path.join(cfg.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    title = f"{cfg.preset} / {cfg.optimizer} / fsdp {fsdp} / {world_size} ranks"
    write_loss_png(os.path.join(cfg.out, "loss.png"), losses, val_loss, title)
    return summary


def _rank_entry(rank: int, world_size: int, cfg: TrainConfig) -> dict | None:
    return train_rank(rank, world_size, cfg, "cpu")


def run(cfg: TrainConfig) -> dict:
    """Launch training (torchrun ranks, forked gloo ranks, or one plain process) and return rank 0's summary."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_torchrun(cfg)
    world_size = 1 if cfg.fsdp == "none" and cfg.world_size == 1 else cfg.world_size
    cfg.validate(world_size)
    load_corpus()  # read once here; forked ranks inherit it
    if cfg.fsdp == "none":
        return train_rank(0, 1, cfg, "cpu")
    from ragged_optim.comm.launch import run_on_ranks

    return run_on_ranks(_rank_entry, world_size, cfg, timeout_s=cfg.timeout_s)[0]


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
    def mib(b: float) -> str:
        return f"{b / 2**20:.2f} MiB"

    lines = [
        f"trained {s['preset']} ({s['n_params']:,} params) with {s['optimizer']}, fsdp {s['fsdp']}, "
        f"{s['world_size']} rank(s), steps {s['start_step']}..{s['steps']}",
        f"  train loss {s['initial_train_loss']:.4f} -> {s['final_train_loss']:.4f} "
        f"(last-10 mean {s['final_train_loss_avg10']:.4f}), val loss {s['val_loss']:.4f}",
        f"  {s['tokens_per_s']:,.0f} tokens/s over {s['train_time_s']:.1f} s",
        f"  per step per rank: {s['collectives_per_step']:.1f} collectives, {mib(s['comm_bytes_per_step'])}",
        f"  per rank: params {', '.join(mib(b) for b in s['param_bytes_per_rank'])}; "
        f"optimizer state {', '.join(mib(b) for b in s['optimizer_state_bytes_per_rank'])}",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    d = TrainConfig()
    p = subparsers.add_parser(
        "train",
        help="train the small GPT with FSDP and a chosen optimizer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default=d.optimizer)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--world-size", type=int, default=d.world_size, help="local gloo ranks (ignored under torchrun)")
    p.add_argument("--preset", default=d.preset, help="model preset: tiny, small, bench20m")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch size (sequences per step)")
    p.add_argument("--seq-len", type=int, default=None, help="override the preset's sequence length")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the optimizer's)")
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    p.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    p.add_argument("--out", default=d.out, help="folder for summary.json and loss.png")
    p.add_argument("--fsdp", choices=FSDP_KINDS, default=d.fsdp, help="'none': one unsharded process")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds before a stuck run is aborted")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=main_from_args)
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        optimizer=args.optimizer,
        steps=args.steps,
        world_size=args.world_size,
        preset=args.preset,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        out=args.out,
        fsdp=args.fsdp,
        seed=args.seed,
        eval_batches=args.eval_batches,
        timeout_s=args.timeout,
        progress=not args.no_progress,
    )


def main_from_args(args: argparse.Namespace) -> int:
    summary = run(config_from_args(args))
    if summary is not None:
        print(format_summary(summary))
        print(f"wrote {os.path.join(args.out, 'summary.json')} and {os.path.join(args.out, 'loss.png')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m ragged_optim.train ...``: the `train` subcommand on its own."""
    parser = argparse.ArgumentParser(prog="ragged-optim")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "DEFAULT_OPTIMIZER",
    "OPTIMIZERS",
    "CommCounter",
    "TrainConfig",
    "add_parser",
    "main",
    "main_from_args",
    "run",
    "train_rank",
]
