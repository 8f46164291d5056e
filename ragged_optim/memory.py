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


def backend_held_bytes(prof, t_ns: int) -> int:
    """Bytes allocated inside a ``c10d::`` op of a CPU profile and still alive at ``t_ns``: a collective backend's
    own copies (gloo's reduce-scatter clones its input). Gloo's worker thread frees a finished work's copy only
    when it picks up its next work, so whether the copy is alive at a given moment is a matter of which worker ran
    the last collective: not something either side of a comparison keeps."""
    allocs = []
    for root in prof.profiler.kineto_results.experimental_event_tree():
        stack = [(root, False)]
        while stack:
            node, in_c10d = stack.pop()
            in_c10d = in_c10d or node.name.startswith("c10d::")
            stack.extend((child, in_c10d) for child in node.children)
            if node.tag == torch._C._profiler._EventType.Allocation and node.start_time_ns < t_ns:
                allocs.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size, in_c10d))
    live: dict[int, int] = {}
    for _, ptr, size, in_c10d in sorted(allocs):
        if size > 0 and in_c10d:
            live[ptr] = size
        elif size < 0:
            live.pop(ptr, None)
    return sum(live.values())
