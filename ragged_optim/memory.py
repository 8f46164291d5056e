"""Peak bytes allocated while a function runs, from the allocator itself (not RSS), on CPU and CUDA.

On CPU the figure is exact: :mod:`ragged_optim.alloc_counter` wraps torch's CPU allocator and counts every
allocation and every free of CPU storage, on whichever thread it happens (a gloo worker thread drops the last
reference to a finished collective's tensors after the profiler's thread-local state is gone: torch's profiler
never hears those frees). On CUDA, ``torch.cuda.max_memory_allocated`` is the figure. Tensors alive before the
call count as the baseline.

torch's profiler stays for attribution (which op allocated what is live at a peak: :func:`sites_at_peak`) and for
the record of what a profiler-only count says (:func:`allocation_timeline`, :func:`step_boundary_bytes`): its
running total only moves for allocator calls on threads that carry the profiler's thread-local state, so frees on
collective worker threads outside a work's run are missed (the total drifts up).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from ragged_optim import alloc_counter


def peak_bytes(fn: Callable[[], Any], device: torch.device | str = "cpu") -> tuple[Any, int]:
    """``(fn(), peak bytes allocated above the baseline while fn ran)``. Nested calls each get their own peak (an
    inner call does not lower the outer one's)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        return out, torch.cuda.max_memory_allocated(device) - base
    alloc_counter.install()
    outer = alloc_counter.reset_peak()
    base = alloc_counter.current()
    try:
        out = fn()
        peak = alloc_counter.stats().peak - base
    finally:
        alloc_counter.restore_peak(outer)
    return out, peak


def settle(quiet_s: float = 0.01, timeout_s: float = 1.0) -> None:
    """Wait (sleeping, so without the GIL) until no CPU allocation or free has happened for ``quiet_s``, at most
    ``timeout_s``: a collective backend's worker thread drops a finished work's tensors a moment after the waiter
    has resumed, so a count read right after a collective may still hold them."""
    alloc_counter.install()
    deadline = time.monotonic() + timeout_s
    last, since = alloc_counter.stats().seq, time.monotonic()
    while (now := time.monotonic()) < deadline:
        time.sleep(quiet_s / 5)
        seq = alloc_counter.stats().seq
        if seq != last:
            last, since = seq, time.monotonic()
        elif now - since >= quiet_s:
            return


#: Ops that allocate on behalf of the op that called them: a site names the caller.
_ALLOCATING_OPS = ("aten::empty", "aten::new_empty", "aten::resize_", "aten::empty_like", "aten::empty_strided")
#: Named regions a site is reported in: FSDP2's record_functions, gloo's work, bench phases, backward nodes.
_REGIONS = ("FSDP::", "gloo:", "## ", "autograd::engine::evaluate_function: ")


def event_name(node) -> str:
    """A profiler event's name; with ``with_stack=True`` torch 2.13 sometimes records a Python event whose name is
    not UTF-8 (reading it raises UnicodeDecodeError): such a name reads as ``"?"``."""
    try:
        return node.name
    except UnicodeDecodeError:
        return "?"


#: Python frames a site never names: wrappers and launchers between the user's call and the code that allocated.
_PLUMBING = (
    "torch/nn/modules/module.py",
    "torch/autograd/",
    "torch/utils/",
    "torch/_tensor.py",
    "torch/distributed/c10d_logger.py",
    "torch/distributed/distributed_c10d.py",
    "torch/optim/optimizer.py",
    "comm/launch.py",
    "/bench/",
    "/benchmarks/",
    "multiprocessing/",
    "threading.py",
)


def _frame(name: str) -> tuple[int, str] | None:
    """``(rank, "path:line function")`` of a Python frame event (``with_stack=True``): rank 0 for this library's
    runtime or torch's FSDP (the code whose memory is compared), 1 for other code that is not plumbing; None for
    plumbing."""
    path, _, rest = name.partition("(")
    line, _, func = rest.partition("): ")
    if any(p in path for p in _PLUMBING):
        return None
    ours = any(f"/{d}/" in path for d in ("sharding", "comm", "kernels", "ragged_optim"))
    short = "/".join(path.split("/")[-2:])
    return (0 if ours or "torch/distributed/fsdp/" in path else 1), f"{short}:{line} {func}"


def _builtin(name: str) -> str:
    """``torch.empty`` for "<built-in method empty of type object at ...>", ``resize_ of X`` for a method of X."""
    words = name.split()
    if len(words) < 3:
        return name
    if len(words) > 4 and words[3] == "of":
        return f"torch.{words[2]}" if words[4] == "type" else f"{words[2]} of {words[4]}"
    return words[2].rstrip(">")


def _site(node) -> str:
    """``op @ frame in region`` for a profiler allocation event: the innermost op above it that is not a bare
    allocation, the innermost Python frame of this library or FSDP2 (profiles taken ``with_stack=True``), and the
    innermost named region (an FSDP2 record_function, a gloo work, a bench phase, a backward node)."""
    op = region = None
    frame: tuple[int, str] | None = None
    first = None
    parent = node.parent
    while parent is not None:
        name = event_name(parent)
        if ".py(" in name:
            f = _frame(name)
            if f is not None and (frame is None or f[0] < frame[0]):
                frame = f
        elif name.startswith(_REGIONS):
            region = region or name.replace("autograd::engine::evaluate_function: ", "")
        elif name.startswith("<built-in"):  # "<built-in method resize_ of torch.storage.UntypedStorage object ...>"
            op = op or _builtin(name)
        else:
            first = first or name
            if op is None and not name.startswith(_ALLOCATING_OPS):
                op = name
        if frame is not None and frame[0] == 0 and region is not None and op is not None:
            break
        parent = parent.parent
    out = op or first or "(outside any op)"
    if frame:
        out += f" @ {frame[1]}"
    if region and region != op:
        out += f" in {region}"
    return out


def allocation_events(prof) -> dict[tuple[int, int], list]:
    """A CPU profile's allocation events (not frees), by (address, bytes), each list in time order."""
    out = defaultdict(list)
    for root in prof.profiler.kineto_results.experimental_event_tree():
        stack = [root]
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node.tag == torch._C._profiler._EventType.Allocation and node.extra_fields.alloc_size > 0:
                out[(node.extra_fields.ptr, node.extra_fields.alloc_size)].append(node)
    for nodes in out.values():
        nodes.sort(key=lambda n: n.start_time_ns)
    return out


def sites_at_peak(prof, seq: int, top: int = 8, base_seq: int = 0, held_seq: int = 0) -> list[dict]:
    """The allocations live just after counter event ``seq`` (a peak's: ``alloc_counter.stats().peak_seq``), by
    site, largest first: ``[{"site", "bytes", "count"}, ...]``. ``prof`` must have started after
    ``alloc_counter.start_recording()`` (and ended before ``stop_recording``); each live allocation the profiler
    heard is matched to its event exactly (same address and size, same rank among those), and those it did not hear
    are named by thread. Allocations made up to counter event ``base_seq`` (the measurement's baseline) are left
    out; those made up to ``held_seq`` (e.g. before the step measured) are marked ``held:``."""
    events = allocation_events(prof)
    main = alloc_counter.install_thread()
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for a in alloc_counter.live_at(seq):
        if a.seq <= base_seq:
            continue
        if a.heard:
            nodes = events.get((a.ptr, a.size), [])
            site = _site(nodes[a.ordinal]) if a.ordinal < len(nodes) else "(heard, but not in the profile)"
        elif a.thread != main:
            site = "(a thread the profiler does not hear: a collective backend's worker)"
        else:
            site = "(allocated while the profiler was off)"
        if a.seq <= held_seq:
            site = "held: " + site
        groups[site][0] += a.size
        groups[site][1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return [{"site": s, "bytes": b, "count": c} for s, (b, c) in ranked[:top]]


def allocation_timeline(prof) -> list[tuple[int, int]]:
    """``(time ns, bytes allocated then)`` for every allocation and free a CPU profile recorded, in time order,
    relative to the bytes allocated just before its first event: the profiler-only count (it misses what threads
    without the profiler's state allocate and free)."""
    events = []
    for root in prof.profiler.kineto_results.experimental_event_tree():
        stack = [root]
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node.tag == torch._C._profiler._EventType.Allocation:
                f = node.extra_fields
                events.append((node.start_time_ns, f.total_allocated, f.alloc_size))
    events.sort()
    if not events:
        return []
    base = events[0][1] - events[0][2]
    return [(t, total - base) for t, total, _ in events]


def step_boundary_bytes(prof, t_ns: int) -> int:
    """The profiler-only count of the bytes alive at a step boundary (what `bench memory` reported before the exact
    count; kept to show its error): bytes that a CPU profile's allocations keep alive at ``t_ns`` (allocated inside
    the profile, not freed before ``t_ns``), less those a collective backend's worker may be the one keeping alive:
    allocations made inside a ``c10d::`` op (the backend's own copies: gloo's reduce-scatter clones its input) and
    the outputs of all-gathers and reduce-scatters (their first tensor argument, so ``prof`` needs
    ``record_shapes=True``). Counted from the allocation events themselves, not the allocator's running total
    (which the gloo workers' own frees move at moments the events do not order)."""
    allocs, written = [], []
    for root in prof.profiler.kineto_results.experimental_event_tree():
        stack = [(root, False)]
        while stack:
            node, in_c10d = stack.pop()
            name = event_name(node)
            in_c10d = in_c10d or name.startswith("c10d::")
            stack.extend((child, in_c10d) for child in node.children)
            if node.start_time_ns >= t_ns:
                continue
            if node.tag == torch._C._profiler._EventType.Allocation:
                allocs.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size, in_c10d))
            elif name.startswith("c10d::") and ("allgather" in name or "reduce_scatter" in name):
                out = next((i for i in node.extra_fields.inputs if hasattr(i, "storage_data_ptr")), None)
                if out is not None:
                    written.append((node.start_time_ns, out.storage_data_ptr))
    live: dict[int, tuple[int, int, bool]] = {}  # ptr -> (allocated at, size, made inside a c10d op)
    for ts, ptr, size, in_c10d in sorted(allocs):
        if size > 0:
            live[ptr] = (ts, size, in_c10d)
        elif size < 0:
            live.pop(ptr, None)
    last_write = {}
    for ts, ptr in written:
        last_write[ptr] = max(ts, last_write.get(ptr, ts))
    return sum(size for ptr, (ts, size, c10d) in live.items() if not (c10d or last_write.get(ptr, -1) >= ts))
