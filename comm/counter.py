"""Counts collectives and their bytes per kind, for tests and benchmarks.

The counter wraps the torch.distributed functions themselves while active, so our collectives and a peer's
(PyTorch FSDP2, torch.optim.Muon on DTensors) are counted by the same rule in the same run. Bytes are the size of
the collective's full buffer: the all-gather output, the reduce-scatter input, the all-to-all input, the
all-reduce / broadcast tensor (what nccl-tests calls the message size).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# name in torch.distributed -> (kind, index of the argument whose bytes count)
_COUNTED = {
    "all_gather_single": ("all_gather", 0),
    "all_gather_into_tensor": ("all_gather", 0),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
    "all_to_all_single": ("all_to_all", 1),
    "all_reduce": ("all_reduce", 0),
    "broadcast": ("broadcast", 0),
    "all_gather": ("all_gather", 1),
}
_INPUT_NAMES = {0: ("output_tensor", "output", "tensor", "tensor_list"), 1: ("input_tensor", "input", "tensor")}


@dataclass
class CommStats:
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def as_dict(self) -> dict:
        return {"calls": dict(self.calls), "bytes": dict(self.bytes)}


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size()
    if isinstance(obj, list | tuple):
        return sum(_nbytes(t) for t in obj)
    return 0


_state = threading.local()

# torch's functional collectives (DTensor redistribution, torch.optim.Muon on DTensors) go through dispatcher ops,
# not the torch.distributed functions: a dispatch mode counts those. op name -> (kind, count its output?)
_FUNCTIONAL = {
    "all_gather_into_tensor": ("all_gather", True),
    "reduce_scatter_tensor": ("reduce_scatter", False),
    "all_reduce": ("all_reduce", False),
    "all_to_all_single": ("all_to_all", False),
    "broadcast": ("broadcast", False),
}


def _functional_counter(stats: CommStats):
    from torch.utils._python_dispatch import TorchDispatchMode

    class FunctionalCollectiveCounter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ns = getattr(func, "namespace", "")
            name = func._schema.name.split("::")[-1] if hasattr(func, "_schema") else ""
            if ns == "_c10d_functional" and name in _FUNCTIONAL:
                kind, use_output = _FUNCTIONAL[name]
                stats.calls[kind] += 1
                stats.bytes[kind] += _nbytes(out if use_output else args[0])
            return out

    return FunctionalCollectiveCounter()


@contextmanager
def count_collectives():
    """Within the block, count every torch.distributed collective this process issues; yields a CommStats.

    Nested calls (one collective implemented by another) count once."""
    stats = CommStats()
    originals = {}

    def wrap(name, fn, kind, arg_index):
        def counted(*args, **kwargs):
            if getattr(_state, "depth", 0) == 0:
                if len(args) > arg_index:
                    obj = args[arg_index]
                else:
                    obj = next((kwargs[k] for k in _INPUT_NAMES[arg_index] if k in kwargs), None)
                stats.calls[kind] += 1
                stats.bytes[kind] += _nbytes(obj)
            _state.depth = getattr(_state, "depth", 0) + 1
            try:
                return fn(*args, **kwargs)
            finally:
                _state.depth -= 1

        counted.__wrapped__ = fn
        return counted

    for name, (kind, idx) in _COUNTED.items():
        fn = getattr(dist, name, None)
        if fn is not None:
            originals[name] = fn
            setattr(dist, name, wrap(name, fn, kind, idx))
    mode = _functional_counter(stats)
    try:
        with mode:
            yield stats
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
