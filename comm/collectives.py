"""Flat collectives over a ProcessGroup, on the non-deprecated torch names where this torch has them.

Every function looks up ``torch.distributed`` at call time, so ``count_collectives`` sees them.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist


class _Completed:
    """The work handle of a collective that ran as a local copy (nothing to wait for)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _alone(group) -> bool:
    """A group of one rank: every collective is a local copy (FSDP2 skips them too), with no backend call."""
    return dist.is_initialized() and dist.get_world_size(group) == 1


def _copied(dst: torch.Tensor, src: torch.Tensor, async_op: bool):
    if dst.data_ptr() != src.data_ptr():
        dst.copy_(src.reshape(dst.shape))
    return _Completed() if async_op else None


def all_gather_flat(output, shard: torch.Tensor, group=None, async_op: bool = False, p2p: bool = False):
    """Gather each rank's ``shard`` (S elements) into ``output`` (W*S elements, rank order), in place. ``p2p``: as
    point-to-point messages where :func:`p2p_serves` (no whole-output buffer of the backend's). A list ``output``
    (the W*S elements as parts with storages of their own) is gathered point to point only."""
    if isinstance(output, list | tuple):
        if not (p2p and p2p_serves(group, shard.device)):
            raise ValueError("all_gather_flat: an output in parts needs point-to-point messages on a gloo group")
        return all_gather_p2p(output, shard, group, async_op)
    if _alone(group):
        return _copied(output, shard, async_op)
    if p2p and p2p_serves(group, output.device):
        return all_gather_p2p(output, shard, group, async_op)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, shard, group=group, async_op=async_op)


def reduce_scatter_flat(
    shard_out: torch.Tensor,
    full: torch.Tensor,
    group=None,
    async_op: bool = False,
    op=dist.ReduceOp.SUM,
    p2p: bool = False,
):
    """Reduce ``full`` (W*S elements) across ranks (a sum by default) into this rank's S-element ``shard_out``.
    ``p2p``: a sum as point-to-point messages where :func:`p2p_serves` (no copy of ``full``; done on return)."""
    if _alone(group):  # sum, average, min or max of one contribution: itself
        return _copied(shard_out, full, async_op)
    if p2p and op == dist.ReduceOp.SUM and p2p_serves(group, full.device):
        return reduce_scatter_p2p(shard_out, full, group, async_op)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(shard_out, full, op=op, group=group, async_op=async_op)


#: Tags of the point-to-point messages below: an all-gather in flight (a prefetch) never takes a reduce-scatter's.
_GATHER_TAG, _REDUCE_TAG = 0x5241, 0x5252


def p2p_serves(group, device: torch.device) -> bool:
    """Whether :func:`all_gather_p2p` / :func:`reduce_scatter_p2p` apply: CPU tensors on a gloo group of several
    ranks. gloo's own all-gather gathers into a new buffer of the whole output and copies it out, and its
    reduce-scatter all-reduces a copy of the whole input: a unit's bytes more, alive until its worker thread
    picks up its next work. NCCL works in place: its collectives stay."""
    if not dist.is_initialized() or torch.device(device).type != "cpu" or dist.get_world_size(group) == 1:
        return False
    return "gloo" in str(dist.get_backend(group)).lower()


class _Works:
    """One handle for several point-to-point works."""

    def __init__(self, works: list):
        self.works = works

    def wait(self, timeout=None) -> bool:
        for w in self.works:
            w.wait()
        self.works = []
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def all_gather_p2p(output, shard: torch.Tensor, group=None, async_op: bool = False):
    """:func:`all_gather_flat` as point-to-point messages straight into ``output``'s slices: this rank's ``shard``
    to each other rank, each other rank's into its slice (all posted at once). No buffer besides ``output``, which
    is one tensor (W*S elements) or a list of tensors that together are those W*S elements in order (separate
    storages, each freed on its own: a unit's params in parts); then a rank's slice that spans parts travels as one
    message per part. Counted by ``count_collectives`` as one all-gather (its output's bytes)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = shard.numel()
    parts = list(output) if isinstance(output, list | tuple) else [output]
    starts = [0]
    for t in parts:
        starts.append(starts[-1] + t.numel())
    if starts[-1] != world * n:
        raise ValueError(f"all_gather_p2p: the output holds {starts[-1]} elements, not world x shard = {world * n}")

    def pieces(k):
        """(piece of the output, its offset in rank k's shard) for rank k's slice, in output order."""
        lo, hi = k * n, (k + 1) * n
        for t, a, b in zip(parts, starts, starts[1:]):
            if a < hi and b > lo:
                x, y = max(a, lo), min(b, hi)
                yield t[x - a : y - a], x - lo

    flat = shard.reshape(-1)
    with torch.no_grad():
        for piece, off in pieces(rank):
            if piece.data_ptr() != flat[off:].data_ptr():
                piece.copy_(flat[off : off + piece.numel()])
    works = []
    for step in range(1, world):
        dst, src = (rank + step) % world, (rank - step) % world
        for piece, off in pieces(rank):
            works.append(dist.isend(flat[off : off + piece.numel()], group=group, group_dst=dst, tag=_GATHER_TAG))
        for piece, _ in pieces(src):
            works.append(dist.irecv(piece, group=group, group_src=src, tag=_GATHER_TAG))
    handle = _Works(works)
    if async_op:
        return handle
    handle.wait()
    return None


def reduce_scatter_p2p(shard_out: torch.Tensor, full: torch.Tensor, group=None, async_op: bool = False):
    """:func:`reduce_scatter_flat` (a sum) as point-to-point messages: slice k of ``full`` goes to rank k as it is
    (no copy), and this rank adds the W slices it gets into ``shard_out`` in rank order (:func:`sum_in_rank_order`):
    the sum is ``((x_0 + x_1) + x_2) + ...`` on every rank, whatever the world size. Done when it returns
    (``async_op`` gives a completed handle). Counted by ``count_collectives`` as one reduce-scatter (its input's
    bytes)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = shard_out.numel()
    piece = lambda k: full[k * n : (k + 1) * n]
    sends = [dist.isend(piece(k), group=group, group_dst=k, tag=_REDUCE_TAG) for k in range(world) if k != rank]
    with torch.no_grad():
        sum_in_rank_order(
            shard_out,
            piece(rank),
            rank,
            world,
            lambda buf, k: dist.irecv(buf, group=group, group_src=k, tag=_REDUCE_TAG),
        )
    for w in sends:
        w.wait()
    return _Completed() if async_op else None


def sum_in_rank_order(out: torch.Tensor, own: torch.Tensor, rank: int, world: int, receive, ahead: int = 2) -> None:
    """``out = ((x_0 + x_1) + x_2) + ...`` where ``x_rank`` is ``own`` and every other ``x_k`` arrives by
    ``receive(buf, k)`` (posts a receive into ``buf``, returns its work). Rank 0's slice is received into ``out``
    itself, the others into at most ``ahead`` buffers of ``out``'s size (with 2, the next receive is posted while
    one is added; with 1, one buffer and no overlap)."""
    spares: list[torch.Tensor] = []
    others = [k for k in range(world) if k != rank]
    posted: dict[int, tuple] = {}

    def post(i: int) -> None:  # the receive from others[i], into out (rank 0's) or a free spare
        if i >= len(others) or others[i] in posted:
            return
        k = others[i]
        if k == 0:
            buf = out
        else:
            busy = {id(b) for b, _ in posted.values()}
            buf = next((b for b in spares if id(b) not in busy), None)
            if buf is None:
                buf = torch.empty_like(out)
                spares.append(buf)
        posted[k] = (buf, receive(buf, k))

    for i in range(ahead):
        post(i)
    for k in range(world):
        if k == rank:
            got = own
        else:
            got, work = posted[k]
            work.wait()
        if k == 0:
            if got.data_ptr() != out.data_ptr():
                out.copy_(got)
        else:
            out.add_(got)
        if k != rank:
            del posted[k]
            i = others.index(k)
            for j in range(ahead):
                post(i + 1 + j)


def all_to_all_flat(output: torch.Tensor, input: torch.Tensor, out_splits, in_splits, group=None):
    """One all_to_all_single with per-rank split sizes (elements); empty splits are allowed."""
    if _alone(group):
        return _copied(output, input, False)
    return dist.all_to_all_single(
        output, input, output_split_sizes=list(out_splits), input_split_sizes=list(in_splits), group=group
    )


def all_reduce_flat(tensor: torch.Tensor, group=None, async_op: bool = False, op=dist.ReduceOp.SUM):
    """Reduce ``tensor`` across ranks in place (a sum by default)."""
    if _alone(group):  # one contribution: already the result
        return _Completed() if async_op else None
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def same_on_every_rank(text: str, group, device) -> bool:
    """Whether ``text`` (a description of what must agree across ranks) is the same on every rank of ``group``: one
    all_reduce (MAX) of a 56-bit digest and its negation, so every rank gets the same answer and can raise together."""
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    all_reduce_flat(both, group=group, op=dist.ReduceOp.MAX)
    return int(both[0]) == -int(both[1])


def serves_cuda(group=None) -> bool:
    """Whether ``group``'s collectives on CUDA tensors run on NCCL: ``init_process_group("nccl")``, a mixed
    ``"cpu:gloo,cuda:nccl"``, or torch's default backend with CUDA present (reported as "undefined")."""
    if not dist.is_initialized():
        return False
    name = str(dist.get_backend(group)).lower()
    if "nccl" in name:
        return True
    if name == "undefined" and torch.cuda.is_available():
        pg = group if group is not None else dist.group.WORLD
        try:
            return "nccl" in type(pg._get_backend(torch.device("cuda"))).__name__.lower()
        except (RuntimeError, AttributeError, ValueError):
            return False
    return False


def grad_divide_plan(
    group, dtype: torch.dtype, divisor: int, device: torch.device | None = None
) -> tuple[float, float, object]:
    """How to average a gradient over ``divisor`` contributions: ``(pre, post, op)``, meaning divide by ``pre``
    before the reduction with ``op`` and by ``post`` after it.

    NCCL averages in the collective itself (``ReduceOp.AVG``) except for fp16, where summing first can overflow.
    Elsewhere (gloo has no AVG), and for fp16, the division is split around a SUM as FSDP does: ``pre`` is the
    smallest power of two at least sqrt(divisor), so the sum of the pre-divided addends is at most sqrt(divisor)
    times the largest of them, and small values lose at most half the exponent range a full pre-division would
    cost. A power-of-two ``pre`` is exact in any float format, so for fp32 and bf16 the result equals summing
    first and dividing once."""
    on_nccl = serves_cuda(group) and (device is None or torch.device(device).type == "cuda")
    if on_nccl and dtype != torch.float16:
        return 1.0, 1.0, dist.ReduceOp.AVG
    pre = 1
    while pre * pre < divisor:
        pre *= 2
    return float(pre), divisor / pre, dist.ReduceOp.SUM
