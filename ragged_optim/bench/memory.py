"""`bench memory`: peak bytes per rank over a full training step, ours against PyTorch FSDP2 on the same GPT.

Per configuration (AdamW; Muon against torch.optim.Muon + AdamW on FSDP2; AdamW with activation checkpointing on
both sides), every rank builds, shards and trains each side for two steps. On CPU the bytes are counted exactly by
:mod:`ragged_optim.alloc_counter` (every allocation and free of CPU storage, whichever thread frees it: a gloo
worker thread drops a finished collective's tensors, gloo's copy of a reduce-scatter's whole input among them,
after the profiler's thread-local state is gone), with a ``torch.profiler`` memory trace beside it for attribution
(the sites live at the peak) and for what a profiler-only count says (``*_profiler_peak_bytes``: its running total
never hears those frees, so it drifts up). On CUDA
the figure is ``torch.cuda.max_memory_allocated``. The figure is the largest number of bytes allocated at any
moment of the second step (forward, backward, optimizer step; optimizer state exists by then), above what was
allocated before the model was built, counting everything alive then: shards, optimizer state, gradients, gathered
params and grads in flight, activations, communication buffers. The max over ranks is reported, with the phase of
the step and the top allocation sites of the rank that peaked highest. ``init_peak_bytes`` is ours building the
same GPT on the meta device, sharding it, ``to_empty`` and ``init_weights``; its bound is this rank's shards plus
the largest unit unsharded (docs/runtime.md).
"""

from __future__ import annotations

import contextlib
import gc

import torch
import torch.distributed as dist

from ragged_optim import alloc_counter
from ragged_optim.bench.common import rank_device
from ragged_optim.comm.launch import run_on_ranks
from ragged_optim.data import get_batch
from ragged_optim.memory import (
    allocation_timeline,
    event_name,
    peak_bytes,
    settle,
    sites_at_peak,
    step_boundary_bytes,
)
from ragged_optim.models import GPT, build_model, get_config, num_params
from ragged_optim.sharding import init_weights, units_of
from ragged_optim.train import shard_model

DESCRIPTION = "peak bytes per rank over a training step (AdamW, Muon, AdamW + activation checkpointing): ours vs FSDP2"
CONFIGS = ("adamw", "muon", "adamw_ac")
_MARK = "## step 2"
#: The phases of a step, as the exact count records which one its peak fell in (index = alloc_counter phase).
PHASES = ("build / step 1", "forward", "backward", "optimizer step", "zero_grad")


def _optimizer(model, kind: str, side: str):
    if kind != "muon":
        return [torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)]
    if side == "ours":
        from ragged_optim.optim import Muon, muon_param_groups

        return [Muon(muon_param_groups(model), lr=0.02)]  # bf16 Newton-Schulz, as torch.optim.Muon
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and "layers." in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "layers." in n)]
    return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-3, weight_decay=0.0)]


def _step(model, opts, x, y, phases: bool = False):
    """One training step; with ``phases``, each phase is marked for the exact count (which phase the peak is in)
    and as a profiler region (``## forward`` ...) for the sites."""
    from torch.profiler import record_function

    def phase(i):
        if phases:
            alloc_counter.set_phase(i)
        return record_function(f"## {PHASES[i]}") if phases else contextlib.nullcontext()

    with phase(1):
        loss = model(x, y)
    with phase(2):
        loss.backward()
    del loss
    for opt in opts:
        with phase(3):
            opt.step()
        with phase(4):
            opt.zero_grad(set_to_none=True)
    if phases:
        alloc_counter.set_phase(0)


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
    return {"peak": max(peak, level), "level_before_step2": level}  # (no phase, sites or profiler figures)


def _train_and_measure(cfg, kind, side, batches, device="cpu", stacks: bool = False) -> dict:
    """The exact count's peak of step 2 above the bytes allocated before the model was built, the level when step 2
    starts (once no allocation or free has happened for a moment: :func:`ragged_optim.memory.settle`; a gloo worker
    keeps its last finished work, and that work's tensors, until it picks up the next one, so they count: they are
    alive), the phase of the peak and the sites live then; beside them, the profiler-only figures as this bench
    computed them before the exact count (the peak of the profiler's running total inside step 2, or the allocation
    events alive at its start less what a collective backend's worker may hold:
    :func:`ragged_optim.memory.step_boundary_bytes`), and the bytes the profiler heard allocated but not freed over
    the whole trace (its drift). ``stacks``: profile with Python stacks, so that sites name the runtime's lines."""
    from torch.profiler import ProfilerActivity, profile

    if torch.device(device).type == "cuda":
        return _train_and_measure_cuda(cfg, kind, side, batches, device)
    alloc_counter.install()
    gc.collect()  # garbage of an earlier measurement freed inside this trace would read as negative bytes
    settle()
    before = alloc_counter.stats()
    base, base_seq = before.current, before.seq
    alloc_counter.start_recording()  # before the profile: every event it hears is in the counter's log
    try:
        with profile(
            activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=stacks
        ) as prof:
            model, opts = _build(cfg, kind, side, "cpu")
            _step(model, opts, *batches[0])
            settle()
            start_seq = alloc_counter.stats().seq
            start = alloc_counter.current() - base
            alloc_counter.reset_peak()
            with torch.profiler.record_function(_MARK):
                _step(model, opts, *batches[1], phases=True)
            st = alloc_counter.stats()
    finally:
        alloc_counter.stop_recording()
    events = allocation_timeline(prof)
    lo, hi = _window(prof, _MARK)
    inside = [t for ts, t in events if lo <= ts <= hi]
    profiler_level = step_boundary_bytes(prof, lo)
    sites = sites_at_peak(prof, st.peak_seq, top=8, base_seq=base_seq, held_seq=start_seq)
    del model, opts, prof
    gc.collect()
    return {
        "peak": st.peak - base,
        "level_before_step2": start,
        "peak_phase": PHASES[st.peak_phase],
        "peak_sites": sites,
        "profiler_peak": max(inside + [profiler_level]),
        "profiler_level_before_step2": profiler_level,
        "unheard_free_bytes": st.unheard_free_bytes - before.unheard_free_bytes,
    }


def _window(prof, name: str) -> tuple[int, int]:
    """Start and end (ns, the allocation events' clock) of the profiled ``record_function(name)``."""
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if event_name(node) == name:
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


#: Per side and configuration, what each rank reports; the max over ranks is the figure, and the phase and sites
#: come from the rank whose peak is the highest.
_FIELDS = {
    "peak_bytes": "peak",
    "start_bytes": "level_before_step2",
    "profiler_peak_bytes": "profiler_peak",
    "profiler_start_bytes": "profiler_level_before_step2",
    "unheard_free_bytes": "unheard_free_bytes",
}


def _rank(rank, world_size, cfg, batch_size, configs, stacks=False):
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
            out[(side, kind)] = _train_and_measure(cfg, kind, side, batches, device, stacks=stacks)
    out["init"] = _init_peak(cfg, device)
    return out


def run(
    world_size: int = 4,
    steps: int | None = None,
    *,
    preset: str = "bench50m",
    also_presets: tuple[str, ...] = ("bench20m",),
    batch_size: int | None = None,
    seq_len: int | None = 32,
    configs: tuple[str, ...] = CONFIGS,
    timeout_s: float = 2400.0,
    device: str = "cpu",
    stacks: bool = False,
    **overrides,
) -> dict:
    """Peak bytes per rank (max over ranks) for each configuration; ``steps`` is ignored (always two). The 54M
    GPT at ``seq_len`` 32 and one row per rank keeps the run in minutes on 2 CPU cores: what differs between the
    two sides is params, grads and state in flight, not activations. ``also_presets``: GPTs measured the same way
    after ``preset``, each under its name (every key) and as ``peak_ratio_vs_fsdp2_<config>_<preset>``. ``stacks``:
    sites name Python lines (the profile records stacks; slower)."""
    del steps
    out = _run_preset(world_size, preset, batch_size, seq_len, configs, timeout_s, device, stacks, **overrides)
    for other in also_presets:
        if other == preset:
            continue
        sub = _run_preset(world_size, other, batch_size, seq_len, configs, timeout_s, device, stacks, **overrides)
        out[other] = sub
        for kind in configs:
            out[f"peak_ratio_vs_fsdp2_{kind}_{other}"] = sub[f"peak_ratio_vs_fsdp2_{kind}"]
    return out


def _run_preset(world_size, preset, batch_size, seq_len, configs, timeout_s, device, stacks, **overrides) -> dict:
    if seq_len is not None:
        overrides["seq_len"] = seq_len
    cfg = get_config(preset, **overrides)
    batch_size = batch_size or world_size
    cpu = torch.device(device).type == "cpu"
    if cpu:
        alloc_counter.install()  # built (first use) and installed here, so the forked ranks inherit it
    results = run_on_ranks(_rank, world_size, cfg, batch_size, configs, stacks, timeout_s=timeout_s, device=device)
    out = {
        "world_size": world_size,
        "preset": preset,
        "params": num_params(build_model(cfg, device="meta")),
        "global_batch": batch_size,
        "seq_len": cfg.seq_len,
        "device": device,
        "measure": (
            "CUDA caching allocator (max_memory_allocated)"
            if not cpu
            else "exact CPU allocator count (ragged_optim.alloc_counter: every allocation and free, any thread); "
            "profiler_* keys: torch.profiler's memory events alone"
        )
        + ", peak of step 2 above the bytes allocated before the build, max over ranks",
    }
    for kind in configs:
        for side in ("ours", "fsdp2"):
            per_rank = [r[(side, kind)] for r in results]
            for key, field in _FIELDS.items():
                if field in per_rank[0]:
                    out[f"{side}_{key}_{kind}"] = max(r[field] for r in per_rank)
            top = max(per_rank, key=lambda r: r["peak"])
            if "peak_phase" in top:
                out[f"{side}_peak_phase_{kind}"] = top["peak_phase"]
                out[f"{side}_peak_sites_{kind}"] = top["peak_sites"]
        out[f"peak_ratio_vs_fsdp2_{kind}"] = out[f"ours_peak_bytes_{kind}"] / out[f"fsdp2_peak_bytes_{kind}"]
        if cpu:
            out[f"profiler_peak_ratio_vs_fsdp2_{kind}"] = (
                out[f"ours_profiler_peak_bytes_{kind}"] / out[f"fsdp2_profiler_peak_bytes_{kind}"]
            )
    for key in results[0]["init"]:
        out[key] = max(r["init"][key] for r in results)
    out["ours_breakdown"] = _breakdown(cfg, world_size)
    out["init_peak_over_bound"] = out["init_peak_bytes"] / out["init_bound_bytes"]
    return out
