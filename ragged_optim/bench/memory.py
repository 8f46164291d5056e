"""`bench memory`: peak bytes per rank over a full training step, ours against PyTorch FSDP2 on the same GPT.

Per configuration (AdamW; Muon against torch.optim.Muon + AdamW on FSDP2; AdamW with activation checkpointing on
both sides), every rank builds, shards and trains each side for two steps inside one allocator trace
(``torch.profiler`` memory events on CPU, ``torch.cuda.max_memory_allocated`` on CUDA). The figure is the largest
number of bytes allocated at any moment of the second step (forward, backward, optimizer step; optimizer state
exists by then), counting everything alive then: shards, optimizer state, gradients, gathered params and grads in
flight, activations, communication buffers. The max over ranks is reported. ``init_peak_bytes`` is ours building
the same GPT on the meta device, sharding it, ``to_empty`` and ``init_weights``; its bound is this rank's shards
plus the largest unit unsharded (docs/runtime.md).
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from ragged_optim.bench.common import rank_device
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.data import get_batch
from ragged_optim.memory import allocation_timeline, peak_bytes, step_boundary_bytes
from ragged_optim.models import GPT, build_model, get_config, num_params
from ragged_optim.sharding import init_weights, units_of
from ragged_optim.train import shard_model

DESCRIPTION = "peak bytes per rank over a training step (AdamW, Muon, AdamW + activation checkpointing): ours vs FSDP2"
CONFIGS = ("adamw", "muon", "adamw_ac")
_MARK = "bench_memory_step2"


def _optimizer(model, kind: str, side: str):
    if kind != "muon":
        return [torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)]
    if side == "ours":
        from ragged_optim.optim import Muon, muon_param_groups

        return [Muon(muon_param_groups(model), lr=0.02)]  # bf16 Newton-Schulz, as torch.optim.Muon
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and "layers." in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "layers." in n)]
    return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-3, weight_decay=0.0)]


def _step(model, opts, x, y):
    model(x, y).backward()
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)


def _build(cfg, kind, side, device):
    model = shard_model(build_model(cfg, seed=0, device=device), "ours" if side == "ours" else "torch")
    model.activation_checkpointing = kind.endswith("_ac")
    return model, _optimizer(model, kind, side)


def _train_and_measure_cuda(cfg, kind, side, batches, device) -> dict:
    """The same figures from the CUDA caching allocator's counters (synchronised, so nothing is in flight)."""
    gc.collect()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    model, opts = _build(cfg, kind, side, device)
    _step(model, opts, *batches[0])
    torch.cuda.synchronize(device)
    level = torch.cuda.memory_allocated(device) - base
    torch.cuda.reset_peak_memory_stats(device)
    _step(model, opts, *batches[1])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del model, opts
    gc.collect()
    return {"peak": max(peak, level), "level_before_step2": level}


def _train_and_measure(cfg, kind, side, batches, device="cpu") -> dict:
    """Bytes allocated at the peak of step 2, counted from before the model was built, and the level before it
    (what is alive then, less what a collective backend's worker may still hold:
    :func:`ragged_optim.memory.step_boundary_bytes`)."""
    from torch.profiler import ProfilerActivity, profile

    if torch.device(device).type == "cuda":
        return _train_and_measure_cuda(cfg, kind, side, batches, device)
    gc.collect()  # garbage of an earlier measurement freed inside this trace would read as negative bytes
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        model, opts = _build(cfg, kind, side, "cpu")
        _step(model, opts, *batches[0])
        with torch.profiler.record_function(_MARK):
            _step(model, opts, *batches[1])
    events = allocation_timeline(prof)
    lo, hi = _window(prof, _MARK)
    inside = [t for ts, t in events if lo <= ts <= hi]
    level = step_boundary_bytes(prof, lo)
    del model, opts
    gc.collect()
    return {"peak": max(inside + [level]), "level_before_step2": level}


def _window(prof, name: str) -> tuple[int, int]:
    """Start and end (ns, the allocation events' clock) of the profiled ``record_function(name)``."""
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.name == name:
            return node.start_time_ns, node.end_time_ns
        stack.extend(node.children)
    raise RuntimeError(f"bench memory: the profile has no {name!r} region")


def _init_peak(cfg, device="cpu") -> dict:
    def build():
        with torch.device("meta"):
            model = GPT(cfg, seed=None)
        shard_model(model, "ours")
        model.to_empty(device=device)
        torch.manual_seed(0)
        init_weights(model, init_fn=_normal_init(model.config.init_std))
        return model

    model, peak = peak_bytes(build, device)
    units = units_of(model)
    shards = sum(u.local_shard.nbytes for u in units)
    largest = max(u.layout.total_size * u.local_shard.element_size() for u in units)
    return {"init_peak_bytes": peak, "init_bound_bytes": shards + largest}


def _normal_init(std):
    """A GPT-like init per module (only the bytes held while it runs are measured here, not its values)."""

    def init(module):
        for name, p in module._parameters.items():
            if p is None:
                continue
            if p.ndim >= 2:
                torch.nn.init.normal_(p, std=std)
            elif name == "weight":
                torch.nn.init.ones_(p)
            else:
                torch.nn.init.zeros_(p)

    return init


def _breakdown(cfg, world_size) -> dict:
    """Our persistent bytes by kind, from the layouts (fp32; AdamW's two moments per param)."""
    n = num_params(build_model(cfg, device="meta"))
    per_rank = 4 * n / world_size
    return {"params": per_rank, "grads": per_rank, "optimizer_state_adamw": 2 * per_rank}


def _rank(rank, world_size, cfg, batch_size, configs):
    device = rank_device()
    batches = [
        tuple(t.to(device) for t in get_batch("train", batch_size, cfg.seq_len, s, rank, world_size)) for s in range(2)
    ]
    if torch.device(device).type == "cuda":
        # First uses allocate for good (cuBLAS workspaces per stream, ...): the side measured first would carry
        # them, so both sides run every configuration once on the `tiny` GPT before anything is measured.
        tiny = get_config("tiny", seq_len=cfg.seq_len)
        for kind in configs:
            for side in ("ours", "fsdp2"):
                _train_and_measure(tiny, kind, side, batches, device)
    out = {}
    for kind in configs:
        for side in ("ours", "fsdp2"):
            dist.barrier()
            r = _train_and_measure(cfg, kind, side, batches, device)
            out[f"{side}_peak_bytes_{kind}"] = r["peak"]
            out[f"{side}_persistent_bytes_{kind}"] = r["level_before_step2"]
    out.update(_init_peak(cfg, device))
    return out


def run(
    world_size: int = 4,
    steps: int | None = None,
    *,
    preset: str = "bench50m",
    batch_size: int | None = None,
    seq_len: int | None = 32,
    configs: tuple[str, ...] = CONFIGS,
    timeout_s: float = 2400.0,
    device: str = "cpu",
    **overrides,
) -> dict:
    """Peak bytes per rank (max over ranks) for each configuration; ``steps`` is ignored (always two). The 54M
    GPT at ``seq_len`` 32 and one row per rank keeps the run in minutes on 2 CPU cores: what differs between the
    two sides is params, grads and state in flight, not activations."""
    del steps
    if seq_len is not None:
        overrides["seq_len"] = seq_len
    cfg = get_config(preset, **overrides)
    batch_size = batch_size or world_size
    results = run_on_ranks(_rank, world_size, cfg, batch_size, configs, timeout_s=timeout_s, device=device)
    out = {
        "world_size": world_size,
        "preset": preset,
        "params": num_params(build_model(cfg, device="meta")),
        "global_batch": batch_size,
        "seq_len": cfg.seq_len,
        "device": device,
        "measure": (
            "CUDA caching allocator (max_memory_allocated)"
            if device == "cuda"
            else "CPU allocator events (torch.profiler profile_memory)"
        )
        + ", peak of step 2, max over ranks",
    }
    for key in results[0]:
        out[key] = max(r[key] for r in results)
    for kind in configs:
        out[f"peak_ratio_vs_fsdp2_{kind}"] = out[f"ours_peak_bytes_{kind}"] / out[f"fsdp2_peak_bytes_{kind}"]
    out["ours_breakdown"] = _breakdown(cfg, world_size)
    out["init_peak_over_bound"] = out["init_peak_bytes"] / out["init_bound_bytes"]
    return out
