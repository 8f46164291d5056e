"""Quantized collectives: block-wise int8 / fp8 parameter all-gather and an int8 gradient reduce-scatter done as
all-to-all plus a local fp32 sum (the ZeRO++ qgZ scheme).

Codes and fp32 scales travel packed in one uint8 buffer per rank: ``numel`` code bytes, then 4 bytes per block.
Callers keep each rank's span a whole number of blocks, so quantizing per rank equals quantizing after the gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ragged_optim.comm.collectives import all_gather_flat
from ragged_optim.kernels import dequantize_blockwise, num_blocks, quantize_blockwise

QUANTIZED_FORMATS = ("int8", "fp8_e4m3")


def packed_nbytes(numel: int, block_size: int) -> int:
    return numel + 4 * num_blocks(numel, block_size)


def pack(x: torch.Tensor, block_size: int, fmt: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (flat) quantized into one uint8 buffer: codes, then the fp32 scales' bytes."""
    n = x.numel()
    if out is None:
        out = torch.empty(packed_nbytes(n, block_size), dtype=torch.uint8, device=x.device)
    codes = out[:n].view(torch.int8) if fmt == "int8" else out[:n]
    scales = torch.empty(num_blocks(n, block_size), dtype=torch.float32, device=x.device)
    quantize_blockwise(x.reshape(-1), block_size, fmt, codes=codes, scales=scales)
    out[n:].copy_(scales.view(torch.uint8))
    return out


def unpack(packed: torch.Tensor, numel: int, block_size: int, fmt: str, out: torch.Tensor) -> torch.Tensor:
    """Dequantize a buffer made by ``pack`` into ``out`` (flat, ``numel`` elements, any float dtype)."""
    codes = packed[:numel].view(torch.int8) if fmt == "int8" else packed[:numel]
    scales = packed[numel:].clone().view(torch.float32)  # clone: the byte offset may not be 4-aligned
    if out.dtype == torch.float32:
        return dequantize_blockwise(codes, scales, block_size, fmt, numel, out=out)
    out.copy_(dequantize_blockwise(codes, scales, block_size, fmt, numel))
    return out


class _PendingGather:
    def __init__(self, work, recv, out, shard_numel, world_size, block_size, fmt):
        self.work, self.recv, self.out = work, recv, out
        self.n, self.w, self.bs, self.fmt = shard_numel, world_size, block_size, fmt

    def wait(self):
        if self.work is not None:
            self.work.wait()
        per = packed_nbytes(self.n, self.bs)
        for k in range(self.w):
            unpack(
                self.recv[k * per : (k + 1) * per], self.n, self.bs, self.fmt, self.out[k * self.n : (k + 1) * self.n]
            )
        return True


def quantized_all_gather(
    out: torch.Tensor, shard: torch.Tensor, fmt: str, block_size: int, group=None, async_op: bool = False
):
    """All-gather ``shard`` (S elements) into ``out`` (W*S) with block-wise quantization on the wire; the
    receiver dequantizes. Returns a handle whose ``wait()`` finishes the dequantization (``async_op=True``)."""
    if fmt not in QUANTIZED_FORMATS:
        raise ValueError(f"quantized all-gather format must be one of {QUANTIZED_FORMATS}, got {fmt!r}")
    w = dist.get_world_size(group)
    send = pack(shard, block_size, fmt)
    recv = torch.empty(w * send.numel(), dtype=torch.uint8, device=shard.device)
    work = all_gather_flat(recv, send, group=group, async_op=async_op)
    pending = _PendingGather(work if async_op else None, recv, out, shard.numel(), w, block_size, fmt)
    if async_op:
        return pending
    pending.wait()
    return None


def quantized_reduce_scatter(shard_out: torch.Tensor, full: torch.Tensor, fmt: str, block_size: int, group=None):
    """Sum ``full`` (W*S) over ranks into this rank's ``shard_out`` (S): each rank quantizes the chunk meant for
    every other rank, one all-to-all moves them, and the owner dequantizes and sums in fp32 (in rank order)."""
    w = dist.get_world_size(group)
    s = full.numel() // w
    per = packed_nbytes(s, block_size)
    send = torch.empty(w * per, dtype=torch.uint8, device=full.device)
    for k in range(w):
        pack(full[k * s : (k + 1) * s], block_size, fmt, out=send[k * per : (k + 1) * per])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    acc = torch.zeros(s, dtype=torch.float32, device=full.device)
    tmp = torch.empty(s, dtype=torch.float32, device=full.device)
    for k in range(w):
        acc += unpack(recv[k * per : (k + 1) * per], s, block_size, fmt, tmp)
    shard_out.copy_(acc)
    return shard_out
