"""Run a function on W local gloo ranks: the embedded launcher used by tests, benchmarks and `train`.

Children are forked, so they inherit the caller's imports (no ~3 s re-import per rank) and any function,
including one defined in a test module, can run without being importable by name.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any


class RankFailure(RuntimeError):
    """A rank raised, died or timed out; the message carries its rank and traceback."""


def free_port() -> int:
    """A TCP port free on this host now (for a torchrun ``--master-port`` or a ``tcp://`` init method)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, args, kwargs, store_path, timeout_s, threads, conn, device="cpu"):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        store = dist.FileStore(store_path, world_size)
        extra = {}
        if device == "cuda":  # one GPU per rank, NCCL
            extra["device_id"] = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(extra["device_id"])
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            **extra,
        )
        ok = False
        try:
            result = fn(rank, world_size, *args, **kwargs)
            ok = True
        finally:
            if dist.is_initialized():  # (fn may have ended it itself)
                if ok:  # a rank that leaves at once would close its sockets while slower peers still connect
                    dist.barrier()
                dist.destroy_process_group()
        # Plain pickle keeps tensors in-band: multiprocessing's own reducers would pass them through shared
        # memory handles that die with this process.
        conn.send(("ok", pickle.dumps(result)))
    except BaseException as e:  # report every failure to the parent, then exit non-zero
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        _exit(1)
    finally:
        conn.close()
    _exit(0)


def _exit(code: int):
    # os._exit skips the interpreter's shutdown (the parent's atexit handlers must not run in a forked child),
    # so flush what the rank printed first.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    threads_per_rank: int | None = None,
    device: str = "cpu",
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forked gloo ranks; return their results.

    Results must be picklable. A rank that raises, dies or exceeds ``timeout_s`` (collectives time out then; a rank
    stuck outside a collective is given 30 s more) ends the run with ``RankFailure`` naming the rank; the remaining
    ranks are killed, so nothing hangs; an interrupt (``KeyboardInterrupt``) kills them too.
    ``threads_per_rank`` > 1: once this process has run a parallel op (a matmul), a forked rank can hang in its
    first parallel region (GNU OpenMP is not fork-safe); the default, 1, never does.
    ``device="cuda"``: NCCL ranks, rank r on GPU r (``fn`` must be importable: CUDA ranks are spawned, not forked).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # the forked ranks would inherit it and fail to start theirs
        raise RuntimeError(
            "run_on_ranks starts a process group in each rank it forks, but this process already has one "
            "(torch.distributed is initialized here): call torch.distributed.destroy_process_group() first, or, "
            "under torchrun, call the function on each rank yourself instead of run_on_ranks"
        )
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' (gloo) or 'cuda' (NCCL), got {device!r}")
    if device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if world_size > gpus:
            raise ValueError(f"world_size={world_size} NCCL ranks need as many GPUs; this machine has {gpus}")
    # One thread per rank by default: a forked child of a parent whose OpenMP pool has run can hang in its first
    # parallel region (GNU OpenMP is not fork-safe), and W ranks share the cores anyway.
    threads = threads_per_rank or 1
    # The first optimizer step in a process imports torch._dynamo (~2 s); do it once here, not once per rank.
    import torch._dynamo  # noqa: F401

    ctx = mp.get_context("spawn" if device == "cuda" else "fork")  # a forked child cannot use CUDA
    with tempfile.TemporaryDirectory(prefix="ro-ranks-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs, conns = [], []
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child,
                args=(fn, rank, world_size, args, kwargs, store_path, timeout_s, threads, child_conn, device),
                daemon=True,
            )
            p.start()
            child_conn.close()
            procs.append(p)
            conns.append(parent_conn)
        return _collect(procs, conns, timeout_s)


def _collect(procs, conns, timeout_s: float) -> list[Any]:
    import time

    deadline = time.monotonic() + timeout_s + 30.0
    results: list[Any] = [None] * len(procs)
    pending = set(range(len(procs)))
    failure, done = None, False
    try:
        while pending and failure is None:
            for rank in sorted(pending):
                conn = conns[rank]
                if conn.poll(0.02):
                    try:
                        status, payload = conn.recv()
                    except EOFError:
                        procs[rank].join(timeout=1)
                        failure = RankFailure(_died(rank, procs))
                        pending.discard(rank)
                        break
                    pending.discard(rank)
                    if status == "ok":
                        results[rank] = pickle.loads(payload)
                    else:
                        failure = RankFailure(f"rank {rank} failed: {payload}")
                        break
                elif not procs[rank].is_alive() and not conn.poll(1.0):  # a last report may still be in flight
                    failure = RankFailure(_died(rank, procs))
                    pending.discard(rank)
                    break
            if failure is None and time.monotonic() > deadline:
                failure = RankFailure(
                    f"ranks {sorted(pending)} did not finish within {timeout_s + 30:.0f} s (timeout_s={timeout_s:g} "
                    "for collectives, plus 30 s): a rank waiting outside a collective, or (threads_per_rank > 1) "
                    "a forked rank stuck in OpenMP"
                )
        if failure is not None:
            failure = _with_peer_errors(failure, procs, conns, pending)
        done = True
    finally:
        for p in procs:  # on a failure or an interrupt (done unset), no rank may outlive the call
            if (failure is not None or not done) and p.is_alive():
                p.kill()
            p.join(timeout=5)
    if failure is not None:
        raise failure
    return results


def _died(rank: int, procs) -> str:
    return f"rank {rank} died (exit code {procs[rank].exitcode}) without a result"


def _with_peer_errors(failure: RankFailure, procs, conns, pending, grace_s: float = 2.0) -> RankFailure:
    """When one rank fails, its peers usually fail too (a closed connection); gather them for a short grace
    period so the report shows the rank that failed first in its own words, not only a peer's echo."""
    import time

    messages = [str(failure)]
    deadline = time.monotonic() + grace_s
    waiting = set(pending)
    while waiting and time.monotonic() < deadline:
        for rank in sorted(waiting):
            if conns[rank].poll(0.02):
                waiting.discard(rank)
                try:
                    status, payload = conns[rank].recv()
                except EOFError:
                    procs[rank].join(timeout=1)
                    messages.append(_died(rank, procs))
                    continue
                if status == "error":
                    messages.append(f"rank {rank} failed: {payload}")
    # The rank that died or raised reads better than the peers' transport errors: those go last.
    messages.sort(key=lambda m: (" died " not in m, "gloo" in m.split("\n", 1)[0]))
    return RankFailure("\n".join(messages))
