"""Peak bytes allocated while a function runs, from the allocator itself (not RSS), on CPU and CUDA.

On CPU torch's profiler with ``profile_memory=True`` records every allocation and free with a running total of
bytes allocated (kept across profiler sessions of the process, so it is taken relative to its value just before
the first recorded event); the peak of that total is the figure. On CUDA,
``torch.cuda.max_memory_allocated`` is the same figure. Tensors alive before the call count as the baseline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def peak_bytes(fn: Callable[[], Any], device: torch.device | str = "cpu") -> tuple[Any, int]:
    """``(fn(), peak bytes allocated above the baseline while fn ran)``."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        return out, torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = allocation_timeline(prof)
    return out, max([0] + [total for _, total in events])


def allocation_timeline(prof) -> list[tuple[int, int]]:
    """``(time ns, bytes allocated then)`` for every allocation and free a CPU profile recorded, in time order,
    relative to the bytes allocated just before its first event."""
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
    """Bytes that a CPU profile's allocations keep alive at ``t_ns`` (allocated inside the profile, not freed before
    ``t_ns``), less those a collective backend's worker may be the one keeping alive: allocations made inside a
    ``c10d::`` op (the backend's own copies: gloo's reduce-scatter clones its input) and the outputs of all-gathers
    and reduce-scatters (their first tensor argument, so ``prof`` needs ``record_shapes=True``). A gloo worker drops
    a finished work, and with it these tensors, when it picks up its next work or gets the GIL, so whether one is
    alive at a given moment depends on which worker ran the last collective and on scheduling: not something either
    side of a comparison keeps. Meant for step boundaries, where a data-parallel runtime holds no collective's output
    (unsharded params are resharded, gradients zeroed). Counted from the allocation events themselves, not the
    allocator's running total (which the gloo workers' own frees move at moments the events do not order)."""
    allocs, written = [], []
    for root in prof.profiler.kineto_results.experimental_event_tree():
        stack = [(root, False)]
        while stack:
            node, in_c10d = stack.pop()
            in_c10d = in_c10d or node.name.startswith("c10d::")
            stack.extend((child, in_c10d) for child in node.children)
            if node.start_time_ns >= t_ns:
                continue
            if node.tag == torch._C._profiler._EventType.Allocation:
                allocs.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size, in_c10d))
            elif node.name.startswith("c10d::") and ("allgather" in node.name or "reduce_scatter" in node.name):
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
