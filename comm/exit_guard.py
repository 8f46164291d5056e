"""Let gloo's worker threads drop their finished collectives before the interpreter shuts down.

A gloo process group runs each collective on a worker thread ("pt_gloo_runloop"), which keeps the work object,
and with it the work's tensors, until just after ``wait()`` has returned to the caller. In torch 2.13 a tensor
whose Python object is alive holds that object while C++ shares the tensor, so when the worker holds the work's
last reference, dropping it takes the GIL (``TensorImpl::decref_pyobject``). If the script ends in that window,
the worker waits for the GIL until the main thread releases it during interpreter shutdown (the final garbage
collection, freeing what holds the process group, does); CPython then ends the worker with ``pthread_exit``
inside the work's ``noexcept`` destructor, ``std::terminate`` runs, and a run that succeeded dies with "terminate
called without an active exception" (SIGABRT; torchrun reports the rank as failed). The worker threads live as
long as anything holds the process group (a model sharded over it, FSDP2's mesh), also after
``destroy_process_group()``.

:func:`install` registers an ``atexit`` handler (atexit runs before CPython marks itself finalizing) that, while
such worker threads exist, hands the GIL over for a moment so that they can drop what they hold.
"""

from __future__ import annotations

import atexit
import os
import time

_WORKER_NAME = "pt_gloo_runloop"
# Long enough for a woken thread to be scheduled on a loaded machine; paid once, at exit, only while a gloo
# process group is still alive.
_HANDOVER_S = 0.05
_installed = False


def gloo_worker_threads() -> int | None:
    """How many gloo worker threads this process has, or None where threads cannot be listed (no /proc)."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return None
    count = 0
    for tid in os.listdir(tasks):
        try:
            with open(os.path.join(tasks, tid, "comm")) as f:
                count += f.read().strip() == _WORKER_NAME
        except OSError:  # the thread ended while we looked
            continue
    return count


def _hand_over_gil() -> None:
    workers = gloo_worker_threads()
    if workers is None:
        import torch.distributed as dist

        workers = int(dist.is_available() and dist.is_initialized())
    if workers:
        time.sleep(_HANDOVER_S * _load_factor())  # sleeping releases the GIL


def _load_factor() -> float:
    """1, or more on a machine with more runnable threads than cores, where a woken thread waits longer to run
    (seen: a rank that finished aborted at exit while the suite and other jobs shared 2 cores), up to 10."""
    try:
        load = os.getloadavg()[0] / max(1, os.cpu_count() or 1)
    except OSError:  # no load average here
        return 1.0
    return min(10.0, max(1.0, load))


def install() -> None:
    """Register the exit handler once per process (idempotent)."""
    global _installed
    if not _installed:
        atexit.register(_hand_over_gil)
        _installed = True
