"""A unit's collectives as functions over a :class:`FlatUnit` (as FSDP2 keeps its own apart from the param group's
state): the all-gather that unshards it, the reduce-scatter of its grads with the HSDP and int8 branches, the
average, and the gathers of full values for users. The unit owns the buffers and decides when these run."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ragged_optim.comm.collectives import all_gather_flat, all_reduce_flat, grad_divide_plan, reduce_scatter_flat
from ragged_optim.comm.quantized import quantized_all_gather, quantized_reduce_scatter


def issue_all_gather(unit):
    """Start filling ``unit.gather_target()`` (allocated: the unsharded buffer or its parts) from every rank's
    shard: ``(work, source, event)``. The source (the local shard, or its cast to the param dtype) must stay alive
    until the work is done."""
    fmt, s, src, after = unit.comm_policy.param_all_gather, unit.streams, unit.local_shard, None
    if fmt != "full":  # quantize the fp32 master shard; the receiver dequantizes into the param dtype
        bs = unit.comm_policy.block_size
        work, event = s.issue(
            s.all_gather_stream,
            lambda: quantized_all_gather(unit.unsharded, src, fmt, bs, group=unit.group, async_op=True),
        )
        return work, src, event
    if unit.param_dtype != unit.dtype:  # the mixed-precision cast, on the copy-in stream
        src = torch.empty(unit.local_shard.shape, dtype=unit.param_dtype, device=unit.device)
        s.copy(src, unit.local_shard)
        after = s.copy_in_stream
    work, event = s.issue(
        s.all_gather_stream,
        lambda: all_gather_flat(unit.gather_target(), src, group=unit.group, async_op=True, p2p=not s.enabled),
        after=after,
    )
    return work, src, event


def issue_reduce_scatter(unit, full: torch.Tensor):
    """Start reducing the flat grads ``full`` (owned by the reduction) into a new [S] output: ``(work, out, op,
    post-divisor, event)``. int8 on the wire sums in fp32; with side streams HSDP's all-reduce across replicas
    follows on the reduce stream, without them :func:`complete_reduce` runs it."""
    s = unit.streams
    if unit.comm_policy.grad_reduce == "int8":
        out = torch.empty(unit.layout.shard_size, dtype=torch.float32, device=unit.device)
        op, post = dist.ReduceOp.SUM, float(unit.gradient_divide_factor or grad_divisor(unit))

        def reduce():
            quantized_reduce_scatter(out, full, "int8", unit.comm_policy.block_size, group=unit.group)
            return _all_reduce_replicas_on_stream(unit, out, op)
    else:
        pre, post, op = divide_plan(unit, full.dtype)
        out = torch.empty(unit.layout.shard_size, dtype=full.dtype, device=unit.device)

        def reduce():
            if pre != 1.0:
                full.div_(pre)
            work = reduce_scatter_flat(out, full, group=unit.group, async_op=True, op=op, p2p=not s.enabled)
            if not s.enabled or unit.replicate_group is None:
                return work
            work.wait()
            return _all_reduce_replicas_on_stream(unit, out, op)

    work, event = s.issue(s.reduce_stream, reduce)
    return work, out, op, post, event


def _all_reduce_replicas_on_stream(unit, out: torch.Tensor, op):
    if not unit.streams.enabled or unit.replicate_group is None:
        return None
    return all_reduce_flat(out, group=unit.replicate_group, async_op=True, op=op)


def complete_reduce(unit, work, out: torch.Tensor, op, post: float, event) -> torch.Tensor:
    """Wait for a reduce-scatter (and, for HSDP without streams, all-reduce across replicas in the reduce dtype);
    the unit's grads as its master dtype, averaged."""
    unit.streams.complete(work, event)
    if unit.replicate_group is not None and not unit.streams.enabled:
        all_reduce_flat(out, group=unit.replicate_group, op=op)
    out = out.to(unit.dtype)
    if post != 1.0:
        out.div_(post)
    return out


def wire_dtype(unit) -> torch.dtype:
    return torch.bfloat16 if unit.comm_policy.grad_reduce == "bf16" else unit.reduce_dtype


def divide_plan(unit, dtype: torch.dtype) -> tuple[float, float, object]:
    """(pre, post, op) of the reduce-scatter: an average over the data-parallel ranks by default; with a divide
    factor, the sum divided by it once after the reduction (1.0: the plain sum), as FSDP2 divides."""
    if unit.gradient_divide_factor is not None:
        return 1.0, unit.gradient_divide_factor, dist.ReduceOp.SUM
    pre, post, op = grad_divide_plan(unit.group, dtype, grad_divisor(unit), unit.device)
    if unit.force_sum_reduction and op != dist.ReduceOp.SUM:  # NCCL's AVG: sum, then divide
        return 1.0, float(grad_divisor(unit)), dist.ReduceOp.SUM
    return pre, post, op


def grad_divisor(unit) -> int:
    rep = dist.get_world_size(unit.replicate_group) if unit.replicate_group is not None else 1
    return unit.world_size * rep


def gather_full(unit, i: int, local: torch.Tensor) -> torch.Tensor:
    """The full value of tensor i from each rank's piece ``local`` (same layout as its sharded param)."""
    buf = torch.zeros(unit.layout.shard_size, dtype=local.dtype, device=unit.device)
    unit.shard_view(buf, i).copy_(local.reshape(-1))
    out = torch.empty(unit.layout.total_size, dtype=local.dtype, device=unit.device)
    all_gather_flat(out, buf, group=unit.group)
    full = unit.full_slice(out, i)
    tp = unit.tp_parts[i]
    return full.clone() if tp is None else tp.full(full)


def gather_master(unit) -> list[torch.Tensor]:
    """Every param's full master value, by one all-gather of the local shard (for tests and debugging)."""
    out = torch.empty(unit.layout.total_size, dtype=unit.dtype, device=unit.device)
    all_gather_flat(out, unit.local_shard, group=unit.group)
    return [unit.full_slice(out, i).clone() for i in range(len(unit.sharded_params))]
