"""The side streams and events of one root's collectives, as FSDP2 uses them; nothing at all on a device without
streams (CPU, where gloo's async work handles are the only concurrency).

Three side streams per root: the all-gather's copy-in (the cast of the master shard to the param dtype), the
all-gather, and the reduce-scatter (with its pre-divide and the HSDP all-reduce after it). A collective issued on a
side stream is waited for by that stream (``work.wait()`` on a stream blocks the stream, not the host), and an
event recorded after it is what the compute stream waits on before it reads the result.

One rule keeps the caching allocator safe without ``record_stream``: every buffer a side stream reads or writes
is allocated on the compute stream (which reads it last and frees it), a side stream waits for the compute stream
before it starts, and the compute stream waits for the side stream's event before it reads the result or drops
the buffer. A side stream may allocate only temporaries that it alone uses (the quantized collectives' staging).
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["CommStreams", "NO_STREAMS", "device_module"]


def device_module(device: torch.device):
    """The torch module that gives ``device`` streams and events (``torch.cuda``, ...), or None (CPU, meta)."""
    if device.type in ("cpu", "meta"):
        return None
    mod = torch.get_device_module(device.type)
    needed = ("Stream", "current_stream", "stream")
    return mod if all(hasattr(mod, n) for n in needed) else None


class CommStreams:
    """One root's side streams on ``device`` (``module``: a device module with streams, or None for none)."""

    def __init__(self, device: torch.device, module=None):
        self.device = torch.device(device)
        self._mod = module
        self.enabled = module is not None
        self.copy_in_stream = self.all_gather_stream = self.reduce_stream = None
        if self.enabled:
            with module.device(self.device) if hasattr(module, "device") else contextlib.nullcontext():
                # high priority, as FSDP2's: communication should not queue behind compute kernels
                self.copy_in_stream = module.Stream(priority=-1)
                self.all_gather_stream = module.Stream(priority=-1)
                self.reduce_stream = module.Stream(priority=-1)

    @classmethod
    def for_device(cls, device: torch.device) -> CommStreams:
        return cls(device, device_module(torch.device(device)))

    def serves(self, device: torch.device) -> bool:
        """Whether these streams are ``device``'s ("cuda" means the current CUDA device, as tensors do)."""
        return _indexed(self.device, self._mod) == _indexed(torch.device(device), self._mod)

    def issue(self, stream, fn, *, after=None):
        """Run ``fn`` (issues async collectives, returns a work handle or None) on ``stream`` once ``after`` (default:
        the compute stream) is done; returns ``(work, event)``, exactly one of them not None unless ``fn`` returned
        None. Without streams, ``fn`` runs here and its work handle is returned to be waited for later."""
        if not self.enabled:
            return fn(), None
        stream.wait_stream(after if after is not None else self._mod.current_stream())
        with self._mod.stream(stream):
            work = fn()
            if work is not None:
                work.wait()  # on a stream: the stream waits for the collective, the host does not
            return None, stream.record_event()

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        """``dst.copy_(src)`` on the copy-in stream (``dst`` allocated by the caller on the compute stream)."""
        if not self.enabled:
            dst.copy_(src)
            return
        self.copy_in_stream.wait_stream(self._mod.current_stream())
        with self._mod.stream(self.copy_in_stream):
            dst.copy_(src)

    def complete(self, work, event) -> None:
        """Make the compute stream (or, without streams, the host) wait for what ``issue`` returned."""
        if work is not None:
            work.wait()
        if event is not None:
            self._mod.current_stream().wait_event(event)


def _indexed(device: torch.device, mod) -> torch.device:
    if device.index is None and mod is not None and hasattr(mod, "current_device"):
        return torch.device(device.type, mod.current_device())
    return device


#: What a unit uses before its root's first forward (and on CPU): collectives as plain async work.
NO_STREAMS = CommStreams(torch.device("cpu"))
