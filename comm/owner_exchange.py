"""Gather blocks whole to an owner rank and scatter results back: one all_to_all_single each way for any number
of blocks (Muon's matrices, split blocks), with per-rank split sizes. Pieces a rank sends to itself never touch
the wire, and when no block needs another rank's data the collective is skipped on every rank alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragged_optim.comm.collectives import all_to_all_flat
from ragged_optim.comm.quantized import pack, packed_nbytes, unpack

#: Elements per scale when pieces travel block-quantized.
WIRE_BLOCK = 128


@dataclass(frozen=True)
class BlockRoute:
    """Where one block's elements live and who computes it. ``pieces``: ``(rank, lo, hi)`` block-local ranges
    in rank order that tile ``[0, numel)``."""

    numel: int
    owner: int
    pieces: tuple[tuple[int, int, int], ...]


class OwnerExchange:
    """A precomputed exchange for a fixed list of routes over ``group`` (this process is ``rank``)."""

    def __init__(self, routes: list[BlockRoute], rank: int, world_size: int, group=None):
        self.routes, self.rank, self.world_size, self.group = routes, rank, world_size, group
        self.needs_wire = any(r != route.owner for route in routes for r, _, _ in route.pieces)
        # Per destination rank, in route order: (route index, lo, hi) this rank sends there.
        self.send = [[] for _ in range(world_size)]
        # Per source rank, in route order: (route index, lo, hi) this rank receives from there.
        self.recv = [[] for _ in range(world_size)]
        for ri, route in enumerate(routes):
            for r, lo, hi in route.pieces:
                if hi <= lo:
                    continue
                if r == rank and route.owner != rank:
                    self.send[route.owner].append((ri, lo, hi))
                if route.owner == rank and r != rank:
                    self.recv[r].append((ri, lo, hi))
        self.send_splits = [sum(hi - lo for _, lo, hi in s) for s in self.send]
        self.recv_splits = [sum(hi - lo for _, lo, hi in s) for s in self.recv]
        self.owned = [ri for ri, route in enumerate(routes) if route.owner == rank]

    def _local_piece(self, route: BlockRoute) -> tuple[int, int] | None:
        for r, lo, hi in route.pieces:
            if r == self.rank and hi > lo:
                return lo, hi
        return None

    def _move(
        self, parts: list[torch.Tensor], send_lists, recv_lists, wire, dtype, device, cast: bool = True
    ) -> list[torch.Tensor]:
        """One all_to_all: ``parts`` go out in ``send_lists`` order; returns the pieces received, in
        ``recv_lists`` order, as ``dtype`` (``cast=False``: in the wire dtype, views of the receive buffer, for a
        caller that copies them into ``dtype`` buffers anyway: no converted copy of the whole buffer).
        ``wire``: a dtype, or ``"int8"`` / ``"fp8_e4m3"`` (block-quantized)."""
        sizes = lambda lists, f: [sum(f(hi - lo) for _, lo, hi in lst) for lst in lists]
        if isinstance(wire, str):
            nbytes = lambda n: packed_nbytes(n, WIRE_BLOCK)
            encoded = [pack(p.contiguous(), WIRE_BLOCK, wire) for p in parts]
            send = torch.cat(encoded) if encoded else torch.empty(0, dtype=torch.uint8, device=device)
            recv_sizes = sizes(recv_lists, nbytes)
            recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
            all_to_all_flat(recv, send, recv_sizes, sizes(send_lists, nbytes), group=self.group)
            pieces, pos = [], 0
            for lst in recv_lists:
                for _, lo, hi in lst:
                    n = hi - lo
                    out = torch.empty(n, dtype=dtype, device=device)
                    pieces.append(unpack(recv[pos : pos + nbytes(n)], n, WIRE_BLOCK, wire, out))
                    pos += nbytes(n)
            return pieces
        send = torch.empty(sum(p.numel() for p in parts), dtype=wire, device=device)
        pos = 0
        for p in parts:  # cast while copying in: one buffer, not a concatenation and its cast copy
            send[pos : pos + p.numel()].copy_(p.reshape(-1))
            pos += p.numel()
        recv_sizes = sizes(recv_lists, lambda n: n)
        recv = torch.empty(sum(recv_sizes), dtype=wire, device=device)
        all_to_all_flat(recv, send, recv_sizes, sizes(send_lists, lambda n: n), group=self.group)
        del send
        return list(torch.split(recv.to(dtype) if cast else recv, [hi - lo for lst in recv_lists for _, lo, hi in lst]))

    def gather(self, local: list[torch.Tensor | None], wire=None, dtype=None, device=None) -> dict:
        """``local[i]``: this rank's piece of route i (1-D, its pieces' length; None if it holds none).
        Returns ``{route index: full 1-D block}`` for the routes this rank owns. ``wire``: the dtype on the wire
        (default: the pieces'), or ``"int8"`` / ``"fp8_e4m3"`` for block-quantized pieces. ``dtype``, ``device``: the
        blocks' (default: the pieces'; give them when a rank may hold no piece, so that every rank agrees and no
        buffer is made off the params' device)."""
        if dtype is None:
            dtype = next((t.dtype for t in local if t is not None), torch.float32)
        if device is None:
            device = next((t.device for t in local if t is not None), torch.device("cpu"))
        full = {ri: torch.empty(self.routes[ri].numel, dtype=dtype, device=device) for ri in self.owned}
        if self.needs_wire:
            parts = [local[ri] for s in self.send for ri, _, _ in s]  # a rank holds one piece of a block
            pieces = iter(self._move(parts, self.send, self.recv, wire or dtype, dtype, device, cast=False))
            for lst in self.recv:  # (each piece cast as it is copied into its block)
                for ri, lo, hi in lst:
                    full[ri][lo:hi] = next(pieces)
        for ri in self.owned:
            mine = self._local_piece(self.routes[ri])
            if mine is not None:
                lo, hi = mine
                full[ri][lo:hi] = local[ri].to(dtype)
        return full

    def scatter(self, results: dict, wire=None, dtype=None, device=None) -> dict:
        """``results``: ``{route index: full 1-D block}`` for the routes this rank owns. Returns
        ``{route index: this rank's piece}`` for every route this rank holds a piece of (in ``dtype``, default the
        results'; give it, and ``device``, when a rank may own no block, so that every rank agrees)."""
        if dtype is None:
            dtype = next((t.dtype for t in results.values()), torch.float32)
        if device is None:
            device = next((t.device for t in results.values()), torch.device("cpu"))
        out = {}
        if self.needs_wire:
            parts = [results[ri][lo:hi] for s in self.recv for ri, lo, hi in s]
            pieces = iter(self._move(parts, self.recv, self.send, wire or dtype, dtype, device))
            for lst in self.send:
                for ri, _, _ in lst:
                    out[ri] = next(pieces)
        for ri in self.owned:
            mine = self._local_piece(self.routes[ri])
            if mine is not None:
                out[ri] = results[ri][mine[0] : mine[1]]
        return out
