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
    "all_gather": ("all_gather", 0),
    "all_to_all": ("all_to_all", 1),  # list forms: the input list's bytes
    "reduce_scatter": ("reduce_scatter", 1),
}
# Our collectives built from point-to-point messages (comm/collectives.py), counted as the collective they are.
_POINT_TO_POINT = {"all_gather_p2p": ("all_gather", 0), "reduce_scatter_p2p": ("reduce_scatter", 1)}
_INPUT_NAMES = {
    0: ("output_tensor", "output", "tensor", "tensor_list"),
    1: ("input_tensor", "input", "tensor", "input_tensor_list", "input_list"),
}


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

    def add(self, other: CommStats) -> None:
        for k, v in other.calls.items():
            self.calls[k] += v
        for k, v in other.bytes.items():
            self.bytes[k] += v

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
_active: list[CommStats] = []  # the count_collectives blocks open now (note() adds to each)


def note(kind: str, nbytes: int) -> None:
    """Count one collective that is not a single torch.distributed call (a reduce-scatter posted in buckets) in
    every ``count_collectives`` block open now."""
    for stats in _active:
        stats.calls[kind] += 1
        stats.bytes[kind] += nbytes


# torch's functional collectives (DTensor redistributions, torch.optim.Muon on DTensors) are separate functions in
# torch.distributed._functional_collectives that DTensor looks up at call time. name -> (kind, count the result?)
_FUNCTIONAL = {
    "all_gather_single": ("all_gather", True),
    "all_gather_tensor": ("all_gather", True),
    "reduce_scatter_single": ("reduce_scatter", False),
    "reduce_scatter_tensor": ("reduce_scatter", False),
    "all_reduce": ("all_reduce", False),
    "all_to_all_single": ("all_to_all", False),
    "broadcast": ("broadcast", False),
}


@contextmanager
def count_collectives():
    """Within the block, count every collective this process issues through torch.distributed or torch's functional
    collectives; yields a CommStats. Nested calls (one collective implemented by another) count once."""
    stats = CommStats()
    originals = {}

    def wrap(fn, kind, arg_index):  # arg_index None: count the result's bytes
        def counted(*args, **kwargs):
            outer = getattr(_state, "depth", 0) == 0
            _state.depth = getattr(_state, "depth", 0) + 1
            try:
                out = fn(*args, **kwargs)
            finally:
                _state.depth -= 1
            if outer:
                if arg_index is None:
                    obj = out
                elif len(args) > arg_index:
                    obj = args[arg_index]
                else:
                    obj = next((kwargs[k] for k in _INPUT_NAMES[arg_index] if k in kwargs), None)
                stats.calls[kind] += 1
                stats.bytes[kind] += _nbytes(obj)
            return out

        counted.__wrapped__ = fn
        return counted

    import torch.distributed._functional_collectives as funcol

    from ragged_optim.comm import collectives

    targets = [(dist, name, kind, idx) for name, (kind, idx) in _COUNTED.items()]
    targets += [(collectives, name, kind, idx) for name, (kind, idx) in _POINT_TO_POINT.items()]
    targets += [(funcol, name, kind, None if res else 0) for name, (kind, res) in _FUNCTIONAL.items()]
    for module, name, kind, idx in targets:
        fn = getattr(module, name, None)
        if fn is not None:
            originals[(module, name)] = fn
            setattr(module, name, wrap(fn, kind, idx))
    _active.append(stats)
    try:
        yield stats
    finally:
        _active.remove(stats)
        for (module, name), fn in originals.items():
            setattr(module, name, fn)
